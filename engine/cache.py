"""Per-sequence inference state: KV cache of the attention layers, conv + recurrent state of the GDN layers.

Everything is preallocated from the context length, so a decode step allocates nothing large. The
attention cache is truncated by length (free rollback); GDN states are small fixed-size tensors that a
multi-token pass can give per position (conv states as views of its input window, recurrent states re-run from
the pass's starting state when asked for), and the one at the last kept position is committed afterwards.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import OutOfMemoryError
from engine.storage.modelfile import HParams


@dataclass
class GDNState:
    conv: torch.Tensor  # [K-1, C] the last K-1 pre-conv inputs (oldest first)
    ssm: torch.Tensor  # [H_v, d_k, d_v] the delta-rule state S
    spare: torch.Tensor | None = None  # a second S buffer: a verify pass writes there and keeps S as it was
    fixed: bool = False  # the buffers stay where they are (a captured step reads and writes them at their addresses)

    def advance_conv(self, window: torch.Tensor, n: int) -> None:
        """After a pass over n new inputs: the state is the window's last K−1 rows. Rebound as a view (no copy; the
        old state may be saved for backward while training), or copied into place when the buffers are fixed."""
        if self.fixed:
            self.conv.copy_(window[n:])
        else:
            self.conv = window[n:]

    def set_conv(self, conv: torch.Tensor) -> None:
        """Take a conv state (a commit's): copied into place when fixed, else rebound to a copy of its own."""
        if self.fixed:
            self.conv.copy_(conv)
        else:
            self.conv = conv.clone()

    def set_ssm(self, ssm: torch.Tensor) -> None:
        """Take a recurrent state a pass made anew (the chunk-parallel rule's): rebound, or copied into place when
        fixed."""
        if self.fixed:
            self.ssm.copy_(ssm)
        else:
            self.ssm = ssm

    def own_conv(self) -> None:
        """Give the conv state storage of its own where it views a long pass's input window: a pass leaves it as
        the window's last K−1 rows, which keeps all K−1+n alive (a 256-token prompt chunk of a 9B model: 8 MiB per
        layer, held through the rest of the prompt). A decode step's window is barely larger: kept as a view."""
        if self.conv.untyped_storage().nbytes() > 2 * self.conv.nbytes:
            self.conv = self.conv.clone()


@dataclass
class KVLayer:
    k: torch.Tensor  # [n_ctx, H_kv, D]
    v: torch.Tensor  # [n_ctx, H_kv, D_v]


class StateReplay:
    """A recurrent layer's state after each of a pass's n positions, without a copy per position: the pass
    keeps its starting state (in the layer's spare buffer) and its inputs, and the state after position i < n − 1
    is made when asked for by re-running the first i + 1 tokens from there (`replay`, the same kernel and so
    the same bits); after the last position it is the live state. Valid until the layer's next pass."""

    def __init__(self, start: torch.Tensor, live: torch.Tensor, n: int,
                 replay: Callable[[int, torch.Tensor, torch.Tensor], None]):
        self.start, self.live, self.n, self.replay = start, live, n, replay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        i = self._index(i)
        if i == self.n - 1:
            return self.live
        out = torch.empty_like(self.start)
        self.replay(i + 1, self.start, out)
        return out

    def write(self, i: int, dst: torch.Tensor) -> None:
        """The state after position i into dst (the live buffer at a commit: no intermediate copy)."""
        i = self._index(i)
        if i < self.n - 1:
            self.replay(i + 1, self.start, dst)
        elif dst is not self.live:
            dst.copy_(self.live)

    def _index(self, i: int) -> int:
        if not -self.n <= i < self.n:
            raise IndexError(f"position {i} of a {self.n}-position pass")
        return i % self.n


class ConvSteps:
    """A GDN layer's conv state after each of a pass's n positions, as views of the pass's input window
    [K−1+n, C] (the old state, then the n new inputs) rather than n copies: after position i it is rows
    i+1 … i+K−1."""

    def __init__(self, window: torch.Tensor, kernel: int):
        self.window, self.kernel = window, kernel

    def __len__(self) -> int:
        return self.window.shape[0] - (self.kernel - 1)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.window[i + 1:i + self.kernel]


@dataclass
class CapturedStates:
    """GDN states after every position of a multi-token pass, per recurrent layer (index = layer)."""

    conv: dict[int, torch.Tensor | ConvSteps]  # layer -> [N, K-1, C]
    ssm: dict[int, torch.Tensor | StateReplay]  # layer -> [N, H_v, d_k, d_v]


class Cache:
    """State of one sequence for the trunk (and, with `layers`, for the MTP block's own attention)."""

    def __init__(self, hp: HParams, n_ctx: int, device: torch.device | str = "cpu",
                 layers: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32,
                 devices: dict[int, torch.device] | None = None, fixed: bool = False):
        """`devices` overrides `device` per layer (a hybrid placement keeps each layer's state beside it). `fixed`:
        every state stays in the buffers allocated here (what captured steps need: they hold the addresses)."""
        self.fixed = fixed
        self.hp = hp
        self.n_ctx = n_ctx
        self.device = torch.device(device)
        dev = {i: torch.device((devices or {}).get(i, self.device)) for i in range(hp.n_layer + 1)}
        self.pos = 0
        attn = hp.attention_layers if layers is None else tuple(i for i in layers)
        rec = hp.recurrent_layers if layers is None else ()
        try:
            self.kv: dict[int, KVLayer] = {
                i: KVLayer(torch.zeros(n_ctx, hp.n_head_kv, hp.head_dim_k, dtype=dtype, device=dev[i]),
                           torch.zeros(n_ctx, hp.n_head_kv, hp.head_dim_v, dtype=dtype, device=dev[i]))
                for i in attn
            }
            self.gdn: dict[int, GDNState] = {
                i: GDNState(torch.zeros(hp.ssm_conv_kernel - 1, hp.ssm_conv_dim, device=dev[i]),
                            torch.zeros(hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim, device=dev[i]),
                            fixed=fixed)
                for i in rec
            }
        except RuntimeError as e:  # allocation failure
            raise OutOfMemoryError(f"cannot allocate the cache for a context of {n_ctx} tokens: {e}") from None

    @property
    def nbytes(self) -> int:
        kv = sum(l.k.nbytes + l.v.nbytes for l in self.kv.values())
        return kv + self.state_nbytes

    @property
    def state_nbytes(self) -> int:
        return sum(s.conv.nbytes + s.ssm.nbytes + (s.spare.nbytes if s.spare is not None else 0)
                   for s in self.gdn.values())

    def reset(self) -> None:
        self.pos = 0
        for s in self.gdn.values():
            if s.fixed:
                s.conv.zero_()
            else:
                s.conv = torch.zeros_like(s.conv)  # rebound: the current one may view a pass's window (ConvSteps)
            s.ssm.zero_()

    def truncate(self, n: int) -> None:
        """Forget attention positions ≥ n (KV entries past `pos` are simply overwritten later).

        GDN states cannot be rewound by length: callers restore them from captured states.
        """
        if not 0 <= n <= self.pos:
            raise ValueError(f"cannot truncate to {n}: cache holds {self.pos} positions")
        self.pos = n

    def commit(self, captured: CapturedStates, index: int) -> None:
        """Take the GDN states reached after position `index` of the last multi-token pass."""
        for i, s in self.gdn.items():
            s.set_conv(captured.conv[i][index])  # the window a pass's ConvSteps view is not kept
            steps = captured.ssm[i]
            if isinstance(steps, StateReplay):
                steps.write(index, s.ssm)
            else:
                s.ssm.copy_(steps[index])
