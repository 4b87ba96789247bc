"""SGLang's host pools as kvtiers sees them: every page of a pool as one or a few chunks.

A host pool SGLang registers with its storage backend (the KV pool, and a hybrid model's
extra pools such as Mamba states) is a ``HostKVCache``: pages of ``page_size`` tokens in
host tensors of the pool's own layout. :meth:`PagePool.register` decides once, per pool,
how a page is stored:

* **Parts, zero-copy.** The pool's ``get_page_buffer_meta(indices)`` names, per page, a
  few contiguous byte ranges of its host memory (page-first layouts: a page's K and its V
  for MHA, one range for MLA). Each range is one chunk (one kvtiers group per position)
  and the tiers' movers read and write that memory in place: no copy on either side. A
  pool qualifies when its layout is not ``layer_first``, a page has at most
  :data:`MAX_PARTS` ranges, every range lies inside one of the pool's contiguous CPU
  tensors, and the pool's data page (``get_data_page(index, flat=False)``) is exactly
  those ranges back to back — checked on pointers, never on contents, so the flat pages
  of SGLang's generic ``get``/``set`` calls split into the very same chunks.
* **Flat, one copy.** Any other pool (``layer_first``, Mamba's gathered states, a pool
  whose ranges lie outside its tensors): a page is one chunk, its flat data page. A store
  gathers it with ``get_data_page(index, flat=True)``; a load reads into a staging tensor
  shaped like ``get_dummy_flat_data_page()`` and, once every byte is verified, scatters it
  with ``set_from_flat_data_page``.

Invariant: every memoryview handed out covers bytes of one page only, inside memory that
stays alive while the view does (a view of a tensor keeps the tensor). Nothing here
touches a page's bytes: the movers do, through the views.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtiers.errors import ConfigError

logger = logging.getLogger(__name__)

#: Most byte ranges one page may have to be stored zero-copy (MHA has 2, MLA 1, MLA with
#: its indexer up to 4); a pool with more (``layer_first``: 2 per layer) is copied.
MAX_PARTS = 8


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable 1-D byte view of a contiguous CPU tensor's memory (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


@dataclass(frozen=True)
class _Buffer:
    """One contiguous CPU tensor of a pool: where its bytes start and a view of them."""

    base: int
    nbytes: int
    view: memoryview


def _host_tensors(pool: Any) -> list[_Buffer]:
    """The pool's contiguous CPU tensors (attributes, or lists and tuples of them), by
    start address; duplicates (one tensor under two names) once."""
    found: dict[int, _Buffer] = {}
    for value in vars(pool).values():
        candidates = value if isinstance(value, (list, tuple)) else (value,)
        for tensor in candidates:
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.device.type == "cpu"
                and tensor.is_contiguous()
                and tensor.numel() > 0
            ):
                nbytes = tensor.numel() * tensor.element_size()
                base = tensor.data_ptr()
                if base not in found or found[base].nbytes < nbytes:
                    found[base] = _Buffer(base, nbytes, byte_view(tensor))
    return [found[base] for base in sorted(found)]


@dataclass
class PagePool:
    """One registered host pool (see the module docstring).

    ``name`` is SGLang's pool name (``kv``, ``mamba``, …); ``part_bytes`` the bytes of
    each chunk of a page, in order; ``zero_copy`` whether those are ranges of the pool's
    own memory (else one flat page, copied); ``page_size`` the pool's tokens per page.
    """

    name: str
    pool: Any
    part_bytes: tuple[int, ...]
    zero_copy: bool
    page_size: int
    reason: str
    _buffers: list[_Buffer]
    _flat_dtype: torch.dtype
    _flat_numel: int
    _bases: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._bases = [b.base for b in self._buffers]

    @classmethod
    def register(cls, name: str, pool: Any) -> PagePool:
        """Inspect ``pool`` once: its page size, its flat page, and whether its pages can
        be stored zero-copy (the module docstring's conditions)."""
        page_size = getattr(pool, "page_size", None)
        if not isinstance(page_size, int) or page_size <= 0:
            raise ConfigError(
                f"SGLang's host pool {name!r} ({type(pool).__name__}) has no positive "
                f"page_size (got {page_size!r}); kvtiers stores whole pages",
                path="register_mem_pool_host",
            )
        dummy = pool.get_dummy_flat_data_page()
        flat_bytes = dummy.numel() * dummy.element_size()
        buffers = _host_tensors(pool)
        parts, reason = _zero_copy_parts(pool, page_size, buffers)
        registered = cls(
            name=name,
            pool=pool,
            part_bytes=parts or (flat_bytes,),
            zero_copy=parts is not None,
            page_size=page_size,
            reason=reason,
            _buffers=buffers,
            _flat_dtype=dummy.dtype,
            _flat_numel=dummy.numel(),
        )
        if parts is not None and sum(parts) != flat_bytes:
            raise ConfigError(
                f"SGLang's host pool {name!r}: its page buffers hold {sum(parts)} bytes but "
                f"its flat page {flat_bytes}; this pool's layout is not supported",
                path="register_mem_pool_host",
            )
        return registered

    @property
    def parts(self) -> int:
        return len(self.part_bytes)

    @property
    def page_bytes(self) -> int:
        return sum(self.part_bytes)

    @property
    def layout(self) -> str:
        return str(getattr(self.pool, "layout", ""))

    # -- views of pages ---------------------------------------------------------------
    def page_starts(self, host_indices: torch.Tensor, pages: int) -> list[int]:
        """The first host index of each of ``pages`` pages in ``host_indices`` (SGLang
        passes ``page_size`` token indices per page)."""
        if host_indices.numel() != pages * self.page_size:
            raise ValueError(
                f"pool {self.name!r}: {host_indices.numel()} host indices for {pages} pages "
                f"of {self.page_size} tokens"
            )
        return [int(i) for i in host_indices[:: self.page_size].tolist()]

    def memory_views(self, host_indices: torch.Tensor, pages: int) -> list[list[memoryview]]:
        """Zero-copy: each page's parts, as views of the pool's memory."""
        assert self.zero_copy
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices[: pages * self.page_size])
        parts = self.parts
        if len(ptrs) != pages * parts or len(sizes) != len(ptrs):
            raise ValueError(
                f"pool {self.name!r}: get_page_buffer_meta gave {len(ptrs)} buffers for "
                f"{pages} pages of {parts} parts"
            )
        views: list[list[memoryview]] = []
        for page in range(pages):
            row = []
            for part in range(parts):
                at = page * parts + part
                if int(sizes[at]) != self.part_bytes[part]:
                    raise ValueError(
                        f"pool {self.name!r}: page buffer of {sizes[at]} bytes, expected "
                        f"{self.part_bytes[part]}"
                    )
                row.append(self._range(int(ptrs[at]), self.part_bytes[part]))
            views.append(row)
        return views

    def gather(self, starts: Sequence[int]) -> list[list[memoryview]]:
        """Flat pool, for a store: each page's flat data page (a copy, or a view where the
        pool's page is contiguous already)."""
        return [[byte_view(self.pool.get_data_page(start, flat=True))] for start in starts]

    def staging(self, pages: int) -> tuple[torch.Tensor, list[list[memoryview]]]:
        """Flat pool, for a load: a staging tensor of ``pages`` flat pages and a view of
        each; :meth:`scatter` copies the pages that arrived into the pool."""
        stage = torch.empty((pages, self._flat_numel), dtype=self._flat_dtype)
        return stage, [[byte_view(stage[page])] for page in range(pages)]

    def scatter(self, stage: torch.Tensor, starts: Sequence[int], arrived: Sequence[bool]) -> None:
        for page, (start, ok) in enumerate(zip(starts, arrived, strict=True)):
            if ok:
                self.pool.set_from_flat_data_page(start, stage[page])

    def split_flat(self, tensor: Any) -> list[memoryview] | None:
        """A flat data page (SGLang's generic ``get``/``set``) split into this pool's
        parts; ``None`` when ``tensor`` is not a contiguous CPU tensor of one page."""
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or tensor.numel() * tensor.element_size() != self.page_bytes
        ):
            return None
        whole = byte_view(tensor)
        views = []
        offset = 0
        for size in self.part_bytes:
            views.append(whole[offset : offset + size])
            offset += size
        return views

    def _range(self, ptr: int, size: int) -> memoryview:
        """The view of ``size`` bytes at address ``ptr`` inside one of the pool's tensors."""
        at = bisect.bisect_right(self._bases, ptr) - 1
        if at >= 0:
            buffer = self._buffers[at]
            offset = ptr - buffer.base
            if offset + size <= buffer.nbytes:
                return buffer.view[offset : offset + size]
        raise ValueError(
            f"pool {self.name!r}: page buffer at {ptr:#x} ({size} bytes) is outside the "
            "pool's host tensors"
        )


def _zero_copy_parts(
    pool: Any, page_size: int, buffers: list[_Buffer]
) -> tuple[tuple[int, ...] | None, str]:
    """The byte sizes of a page's parts when ``pool`` can be stored zero-copy, else
    ``None``; and why (for the log)."""
    layout = str(getattr(pool, "layout", ""))
    if layout == "layer_first":
        return None, "layer_first pages are scattered over every layer's tensor"
    meta: Callable[[torch.Tensor], Any] | None = getattr(pool, "get_page_buffer_meta", None)
    if meta is None:
        return None, "the pool has no get_page_buffer_meta"
    try:
        ptrs, sizes = meta(torch.arange(page_size, dtype=torch.int64))
        data = pool.get_data_page(0, flat=False)
    except Exception as exc:  # a pool that cannot describe its pages is copied instead
        return None, f"get_page_buffer_meta failed: {type(exc).__name__}: {exc}"
    if not 0 < len(ptrs) <= MAX_PARTS or len(sizes) != len(ptrs):
        return None, f"a page has {len(ptrs)} buffers (at most {MAX_PARTS} are stored in place)"
    ranges = [(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]
    bases = [b.base for b in buffers]
    for ptr, size in ranges:
        at = bisect.bisect_right(bases, ptr) - 1
        if at < 0 or ptr - buffers[at].base + size > buffers[at].nbytes:
            return None, "its page buffers lie outside the pool's contiguous host tensors"
    pieces = [data] if len(ranges) == 1 else (
        [data[i] for i in range(data.shape[0])] if data.dim() and data.shape[0] == len(ranges)
        else []
    )
    same = len(pieces) == len(ranges) and all(
        piece.is_contiguous()
        and piece.data_ptr() == ptr
        and piece.numel() * piece.element_size() == size
        for piece, (ptr, size) in zip(pieces, ranges, strict=True)
    )
    if not same:
        return None, "its flat data page is not its page buffers back to back"
    return tuple(size for _, size in ranges), f"{layout}: {len(ranges)} buffers per page"
