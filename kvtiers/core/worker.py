"""The worker contract: GPU KV blocks ⇄ the primary tier's medium.

A worker runs in the engine's worker process. Each job moves one or more groups, one
:class:`~kvtiers.core.specs.GroupTransfer` per group; the method name gives the direction.
Submission returns at once; completions are collected with :meth:`get_finished`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtiers.core.specs import GroupTransfer
from kvtiers.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvtiers.core.config import OffloadingConfig


@dataclass(frozen=True)
class KVTensorRef:
    """One layer of a group: which engine tensor holds it, and its un-padded page bytes."""

    tensor_idx: int
    page_bytes: int


@dataclass(frozen=True)
class KVCacheTensors:
    """The engine's KV cache as a worker sees it.

    ``tensors`` are byte views of shape ``(num_blocks, padded_page_bytes)`` (uint8 or int8,
    on CPU or CUDA); ``groups[g]`` lists group ``g``'s layers in order. A group's bytes per
    block is the sum of its refs' ``page_bytes``; within a chunk its layout is tensor-major
    (see :mod:`kvtiers.core.geometry`).
    """

    tensors: Sequence[torch.Tensor]
    groups: Sequence[Sequence[KVTensorRef]]

    def group_bytes_per_block(self, group_idx: int) -> int:
        return sum(ref.page_bytes for ref in self.groups[group_idx])

    @classmethod
    def from_layers(
        cls, layers: Mapping[str, torch.Tensor], config: OffloadingConfig
    ) -> KVCacheTensors:
        """Describe a per-layer KV cache (``{layer name: tensor}``, as engines keep it).

        Each tensor's first dimension is the block index, and one block of it holds one
        page of ``bytes_per_block / layers`` bytes of its group (rows may be padded
        beyond). Tensors are viewed as bytes, never copied. Raises :class:`ConfigError`
        naming the layer when one is missing or has the wrong shape."""
        import torch

        tensors: list[torch.Tensor] = []
        groups: list[list[KVTensorRef]] = []
        for group_idx, group in enumerate(config.groups):
            page_bytes = group.bytes_per_block // len(group.layer_names)
            refs = []
            for name in group.layer_names:
                if name not in layers:
                    raise ConfigError(
                        f"no KV tensor for layer {name!r} of group {group_idx}; the mapping "
                        f"must hold every layer the configuration names (it has "
                        f"{len(layers)}: {', '.join(sorted(layers)[:4])}…)",
                        path="kv_caches",
                    )
                tensor = layers[name]
                try:
                    rows = tensor.view(tensor.shape[0], -1).view(torch.uint8)
                except RuntimeError as exc:
                    raise ConfigError(
                        f"KV tensor of layer {name!r} (shape {tuple(tensor.shape)}) cannot be "
                        f"viewed as (num_blocks, bytes) without a copy: {exc}",
                        path="kv_caches",
                    ) from None
                if rows.shape[1] < page_bytes:
                    raise ConfigError(
                        f"KV tensor of layer {name!r} holds {rows.shape[1]} bytes per block; "
                        f"group {group_idx} needs {page_bytes} (bytes_per_block / layers)",
                        path="kv_caches",
                    )
                refs.append(KVTensorRef(len(tensors), page_bytes))
                tensors.append(rows)
            groups.append(refs)
        return cls(tensors, groups)


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one worker job: success, bytes moved and seconds it took."""

    job_id: int
    success: bool
    transfer_bytes: int = 0
    transfer_s: float = 0.0


class OffloadingWorker(ABC):
    """Asynchronous GPU ⇄ primary copies."""

    @abstractmethod
    def submit_store(self, job_id: int, groups: Sequence[GroupTransfer]) -> bool:
        """Start copying GPU blocks into the primary medium. False: not accepted."""

    @abstractmethod
    def submit_load(self, job_id: int, groups: Sequence[GroupTransfer]) -> bool:
        """Start copying from the primary medium into GPU blocks. False: not accepted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call."""

    @abstractmethod
    def wait(self, job_ids: Collection[int]) -> None:
        """Block until every listed job has finished (results stay for ``get_finished``)."""

    def shutdown(self) -> None:
        """Finish or abandon outstanding work and release resources. Idempotent."""
