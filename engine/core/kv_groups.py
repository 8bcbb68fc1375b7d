"""KV cache groups: how the layers of a model with sliding-window attention share one block pool.

A global-attention layer needs every key of a request; a sliding-window layer with window W needs
only the keys of the last W positions. When every layer is of one kind, the pool works as it always
did: a block holds `block_size` tokens of every layer and a request has one block table. When the
layers mix kinds (Gemma 2: alternating; Gemma 3: five sliding to one global; Qwen2 with
`max_window_layers`), a sliding layer's old blocks could be given back while the global layers
still need theirs, so the layers are split into *KV groups* of equal size (the scheme of vLLM's
hybrid KV cache manager, `vllm/v1/core/kv_cache_coordinator.py`):

* every group holds `group_size` layers of one kind; a kind whose layer count is not a multiple
  of `group_size` ends with a partial group (its missing slots are unused memory);
* the pool keeps `group_size` K/V tensors ("slots"), each `[2, num_blocks, block_size, ...]`;
  layer l lives in tensor `layer_slot[l]`, and a block id, while one group of one request holds
  it, stores that group's layers in those tensors;
* a request has one block table per group; the tables of a sliding group drop (give back, and
  point at the null block 0) the blocks its window can no longer see
  (`engine.core.block_pool.BlockPool.slide`).

So a block costs `group_size` layers' bytes, and a request of n tokens holds
⌈n / block_size⌉ blocks per global group and about ⌈(W + a step's tokens) / block_size⌉ + 1 per
sliding group. Torch-free, like the rest of `engine.core`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["KVGroups"]


@dataclass(frozen=True, slots=True)
class KVGroups:
    """The KV groups of a model's layers.

    Attributes:
        windows: per group, None (global attention: every key kept) or its sliding window W in
            tokens (a query at position p reads keys p - W + 1 .. p). Group 0 is global when any
            layer is.
        layer_group: per layer, its group.
        layer_slot: per layer, its slot (K/V tensor) within the group, 0 .. group_size - 1.
        group_size: layers per group (the number of K/V tensors the pool keeps).
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    group_size: int

    @classmethod
    def single(cls, n_layers: int) -> "KVGroups":
        """One global group of all `n_layers` layers (every model without a sliding window)."""
        return cls((None,), (0,) * n_layers, tuple(range(n_layers)), n_layers)

    @classmethod
    def for_layers(cls, layer_windows: Sequence[int | None], max_context: int) -> "KVGroups":
        """The groups of layers whose sliding windows are `layer_windows` (None: global).

        A window of `max_context` tokens or more never drops a key, so such a layer counts as
        global. The group size is the smallest count of layers of one kind (vLLM's choice): for
        Gemma 3 270M (15 sliding, 3 global) six groups of 3; Gemma 2 2B (13 + 13) two groups of 13;
        Mistral (every layer sliding) one group of all layers.

        Raises:
            ValueError: no layers, or a window below 1.
        """
        if not layer_windows:
            raise ValueError("a model needs at least one layer")
        kinds: dict[int | None, list[int]] = {}
        for i, w in enumerate(layer_windows):
            if w is not None and w < 1:
                raise ValueError(f"layer {i}: sliding window {w} must be >= 1")
            kinds.setdefault(None if w is None or w >= max_context else w, []).append(i)
        size = min(len(layers) for layers in kinds.values())
        windows: list[int | None] = []
        group = [0] * len(layer_windows)
        slot = [0] * len(layer_windows)
        # Global first, so group 0's table always covers every position when any layer is global.
        for kind in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            layers = kinds[kind]
            for start in range(0, len(layers), size):
                for j, layer in enumerate(layers[start:start + size]):
                    group[layer], slot[layer] = len(windows), j
                windows.append(kind)
        return cls(tuple(windows), tuple(group), tuple(slot), size)

    @property
    def num_groups(self) -> int:
        """Groups (block tables per request)."""
        return len(self.windows)

    @property
    def sliding(self) -> bool:
        """True when some group drops blocks out of its window."""
        return any(w is not None for w in self.windows)
