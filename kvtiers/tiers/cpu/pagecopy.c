/* kvtiers page copy: page i of nbytes[i] bytes goes from address src[i] to address dst[i].
 *
 * Built and loaded by kvtiers/tiers/cpu/pagecopy.py (ctypes releases the GIL around the
 * call). The caller guarantees that every range lies inside memory it owns and that no
 * destination overlaps a source or another destination. With threads > 1 the pages are cut
 * into that many consecutive runs of about equal bytes, one per thread; a thread that cannot
 * be started has its run copied by the calling thread, so the copy always completes.
 * Returns the number of threads that copied.
 *
 * With streaming set (and SSE2 available) pages are written with non-temporal stores, which
 * skip reading each destination line into the cache before overwriting it: for copies much
 * larger than the cache, as a job of many pages is, that saves a third of the memory
 * traffic. Small copies should not stream: their destination is likely read again soon.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define KVTIERS_MAX_THREADS 16

typedef struct {
    int64_t begin;
    int64_t end;
    const int64_t *dst;
    const int64_t *src;
    const int64_t *nbytes;
    int streaming;
} kvtiers_run;

#if defined(__SSE2__)
/* memcpy with 16-byte non-temporal stores for the aligned middle of the destination. */
static void kvtiers_stream_copy(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    size_t i = 0;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#endif

static void *kvtiers_copy_run(void *arg) {
    const kvtiers_run *run = (const kvtiers_run *)arg;
#if defined(__SSE2__)
    if (run->streaming) {
        for (int64_t i = run->begin; i < run->end; i++) {
            kvtiers_stream_copy((char *)(uintptr_t)run->dst[i],
                                (const char *)(uintptr_t)run->src[i], (size_t)run->nbytes[i]);
        }
        /* Non-temporal stores are weakly ordered: make them visible before returning. */
        _mm_sfence();
        return NULL;
    }
#endif
    for (int64_t i = run->begin; i < run->end; i++) {
        memcpy((void *)(uintptr_t)run->dst[i], (const void *)(uintptr_t)run->src[i],
               (size_t)run->nbytes[i]);
    }
    return NULL;
}

int kvtiers_copy_pages(int64_t n, const int64_t *dst, const int64_t *src, const int64_t *nbytes,
                       int threads, int streaming) {
    kvtiers_run runs[KVTIERS_MAX_THREADS];
    pthread_t ids[KVTIERS_MAX_THREADS];
    int started[KVTIERS_MAX_THREADS];
    int64_t total = 0;
    int64_t i = 0;
    int count = 0;

    if (threads > KVTIERS_MAX_THREADS) threads = KVTIERS_MAX_THREADS;
    if (threads > n) threads = (int)n;
    if (threads < 2) {
        kvtiers_run all = {0, n, dst, src, nbytes, streaming};
        kvtiers_copy_run(&all);
        return 1;
    }
    for (int64_t k = 0; k < n; k++) total += nbytes[k];
    /* Run t ends at the first page boundary at or past (t + 1) / threads of the bytes. */
    int64_t done = 0;
    for (int t = 0; t < threads && i < n; t++) {
        int64_t goal = t == threads - 1 ? total : total / threads * (t + 1);
        runs[t].begin = i;
        while (i < n && done < goal) done += nbytes[i++];
        runs[t].end = i;
        runs[t].dst = dst;
        runs[t].src = src;
        runs[t].nbytes = nbytes;
        runs[t].streaming = streaming;
        count = t + 1;
    }
    for (int t = 1; t < count; t++) {
        started[t] = pthread_create(&ids[t], NULL, kvtiers_copy_run, &runs[t]) == 0;
    }
    kvtiers_copy_run(&runs[0]);
    int used = 1;
    for (int t = 1; t < count; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
            used++;
        } else {
            kvtiers_copy_run(&runs[t]);
        }
    }
    return used;
}
