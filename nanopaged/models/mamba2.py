"""The Mamba-2 mixer of a hybrid model (Granite 4.0-H, transformers' `granitemoehybrid`), over paged state.

A state-space layer replaces attention's growing K/V with a fixed-size state per request: the last
kernel-1 inputs of a short causal convolution, and an SSM state h of (heads, head_dim, state) that every
token updates:

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T        y_t = h_t C_t + D * x_t

The engine hands a step as one flat list of rows (request i owns rows sum(query_lens[:i]) up to
sum(query_lens[:i+1])); request i's state lives in page pages[i] of two preallocated float32 tensors,
read at the start of the step and written back in place at its end. Prefill rows run the chunked scan
(`ssd_chunked`, Mamba-2's state-space duality) per request; decode rows (one new token) run the
one-token recurrence (`ssd_step`) batched across requests.
"""
from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn
from torch.nn import functional as F

from nanopaged.models.hybrid import Mamba2Shape


# ---------------------------------------------------------------- the reference functions


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution continuing from the last kernel-1 inputs; no activation.

    x (..., T, C), weight (C, K), conv_state (..., C, K-1) -> y (..., T, C), new conv state (..., C, K-1).
    y[t, c] = bias[c] + sum_j weight[c, j] * window[t + j, c], where window = the state's inputs, then x.
    """
    window = torch.cat([conv_state.transpose(-1, -2), x], dim=-2)     # (..., K-1+T, C)
    taps = window.unfold(-2, weight.shape[-1], 1)                     # (..., T, C, K): row t sees window[t:t+K]
    y = (taps * weight).sum(-1)
    if bias is not None:
        y = y + bias
    # the last K-1 inputs are the next call's left context (window[T:], right even when K-1 == 0)
    return y, window[..., x.shape[-2]:, :].transpose(-1, -2)


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """(..., L) -> (..., L, L): out[l, s] = a[s+1] + ... + a[l] for s <= l (0 on the diagonal), -inf above.

    exp(out) is the decay from position s to position l. Summing the masked terms directly, rather
    than subtracting two cumulative sums, keeps a long chunk's small differences exact.
    """
    L = a.shape[-1]
    below = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    terms = a[..., :, None].expand(*a.shape, L).masked_fill(~below, 0.0)   # terms[j, s] = a[j] if j > s
    sums = terms.cumsum(dim=-2)                                            # sums[l, s] = sum of a[j], s < j <= l
    return sums.masked_fill(~torch.tril(torch.ones_like(below)), -torch.inf)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor, chunk_size: int, initial_state: torch.Tensor, keep: tuple[int, ...] = ()):
    """One request's scan, chunk by chunk (Mamba-2's state-space duality). All float32.

    x (T, H, P), dt (T, H) after softplus, A (H,) negative, B and C (T, G, N) one per group of H // G heads,
    D (H,), initial_state (H, P, N) -> y (T, H, P), final state (H, P, N), and {t: the state after t tokens}
    for each t in `keep` (multiples of chunk_size, or T: a chunk's end; a block boundary's snapshot).
    Within a chunk the recurrence unrolls into a masked quadratic form, like causal attention:
        y_l = sum_{s<=l} exp(a_{s+1} + ... + a_l) (C_l . B_s) dt_s x_s   (a = dt * A, the log-decay)
    plus the state carried in from the chunks before, decayed to position l and read by C_l. Heads first
    throughout (each matrix product one batched call), and C_l . B_s once per group, not per head.
    """
    T, H, P = x.shape
    G, N = B.shape[1:]
    L = min(chunk_size, -(-T // 16) * 16)                              # a short prompt pads to 16s, not a chunk
    K = -(-T // L)
    # pad to whole chunks with dt = 0: a padded step decays by exp(0) = 1 and adds nothing,
    # so the state after the last chunk is the state after token T
    pad = K * L - T
    xdt = F.pad((x * dt[..., None]).transpose(0, 1), (0, 0, 0, pad)).reshape(H, K, L, P)   # the input dt_s x_s
    a = F.pad((dt * A).t(), (0, pad)).reshape(H, K, L)                 # the log-decay of each step
    Bg, Cg = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)).reshape(G, 1, K, L, N) for t in (B, C))
    a_cum = a.cumsum(dim=-1)                                           # (H, K, L) from the chunk's start
    heads = (G, H // G, K)                                             # a head's index split into (group, its place)

    # 1. inside each chunk: scores C_l . B_s per group, masked by each head's causal decay, applied to the inputs
    decay = torch.exp(segment_sums(a)).view(*heads, L, L)              # 0 above the diagonal
    scores = (Cg @ Bg.transpose(-1, -2)) * decay                       # (G, H // G, K, L, L)
    y = scores.view(H, K, L, L) @ xdt                                  # (H, K, L, P)

    # 2. what each chunk adds to the state by its end: its inputs, each decayed to the chunk's last step
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                        # (H, K, L)
    added = ((xdt * to_end[..., None]).view(*heads, L, P).transpose(-1, -2) @ Bg).view(H, K, P, N)

    # 3. across chunks: carry the state, one chunk at a time (few chunks, so a plain loop)
    state, starts = initial_state, []
    for k in range(K):
        starts.append(state)
        state = torch.exp(a_cum[:, k, -1])[:, None, None] * state + added[:, k]

    # 4. the carried state's part of each output: decayed from the chunk's start to l, read by C_l
    carried = (Cg @ torch.stack(starts, 1).view(*heads, P, N).transpose(-1, -2)).view(H, K, L, P)
    y = y + carried * torch.exp(a_cum)[..., None]
    kept = {t: (starts[t // L] if t < T else state) for t in keep}
    return y.reshape(H, K * L, P)[:, :T].transpose(0, 1) + D[:, None] * x, state, kept


def paged_conv_step(x, weight, bias, pages: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """One token per request through `causal_conv1d` and SiLU, over state pages as paged_ssd_step below."""
    states = pages[index].masked_fill(fresh[:, None, None], 0)
    out, pages[index] = causal_conv1d(x[:, None, :], weight, bias, states)
    return F.silu(out[:, 0, :])


def paged_ssd_step(x, dt, A, B, C, D, pages: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """`ssd_step` over state pages: row r's state read from pages[index[r]] (zeros where fresh[r]: a one-token
    prompt) and written back. The fast path's kernel keeps this signature (cpu/recurrent.py)."""
    state = pages[index].masked_fill(fresh[:, None, None, None], 0)
    y, pages[index] = ssd_step(x, dt, A, B, C, D, state)
    return y


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, R requests at once: the recurrence itself. All float32.

    x (R, H, P), dt (R, H), A (H,), B and C (R, H, N), D (H,), state (R, H, P, N) -> y (R, H, P), new state.
    """
    decay = torch.exp(dt * A)[..., None, None]                         # (R, H, 1, 1)
    state = decay * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("rhpn,rhn->rhp", state, C)
    return y + D[:, None] * x, state


# ---------------------------------------------------------------- the mixer


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(gate), each group of channels normalised on its own (Mamba-2's norm_before_gate=False)."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = y.float() * F.silu(gate.float())
        groups = y.reshape(*y.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * groups.reshape(y.shape)


class Mamba2Mixer(nn.Module):
    """Mamba-2 over a step's flat rows, each request's conv and SSM state in its page.

    Parameter names are transformers' GraniteMoeHybridMambaLayer's, so its state_dict loads as is.
    """

    def __init__(self, shape: Mamba2Shape, steps: dict | None = None) -> None:
        super().__init__()
        self.shape = s = shape
        steps = steps or {}     # a decode token's kernels, the fast path's (cpu/recurrent.py), else the reference
        self.conv_step = steps.get("conv", paged_conv_step)
        self.decode_step = steps.get("ssd", paged_ssd_step)
        # in_proj makes, per token: the gate z, the convolution's input (x, B, C), and dt per head
        self.in_proj = nn.Linear(s.hidden_size, s.intermediate_size + s.conv_dim + s.num_heads, bias=s.use_bias)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim,
                                padding=s.conv_kernel - 1, bias=s.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, s.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm = GatedRMSNorm(s.intermediate_size, s.intermediate_size // s.n_groups, s.rms_norm_eps)
        self.out_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.use_bias)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                query_lens: list[int], pages: list[int], has_state: list[bool] | None = None,
                snapshots: list[dict[int, int]] | None = None) -> torch.Tensor:
        """x (tokens, hidden) -> (tokens, hidden) in x's dtype; request i's state read from and written to pages[i].

        conv_state (num_pages, conv_dim, K-1) and ssm_state (num_pages, H, P, N) are float32 and may be
        strided views into a larger tensor: they are only ever indexed, never reshaped. `has_state[i]` False:
        request i starts from zero whatever its page holds (None: every page is read). `snapshots[i]`:
        {rows: page}, the state after that many of request i's rows kept in that page too (prefix caching).
        """
        has_state = has_state or [True] * len(query_lens)
        snapshots = snapshots or [{}] * len(query_lens)
        self._check_step(x, conv_state, query_lens, pages)
        s = self.shape
        gate, xBC, dt = self.in_proj(x).split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        # the scan in float32 whatever the model's dtype: the state is a product of decays carried over
        # every token the request has seen, and bfloat16's short mantissa would round it at every step
        xBC, weight = xBC.float(), self.conv1d.weight.float()[:, 0, :]    # weight (conv_dim, K)
        bias = self.conv1d.bias.float() if self.conv1d.bias is not None else None
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*s.time_step_limit)
        y = torch.empty(x.shape[0], s.num_heads, s.head_dim, dtype=torch.float32, device=x.device)

        starts = [0, *accumulate(query_lens)]          # where each request's rows begin
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=x.device)
            page_ids = torch.tensor([pages[i] for i in decode], device=x.device)
            fresh = torch.tensor([not has_state[i] for i in decode], device=x.device)
            y[rows] = self._decode(xBC[rows], dt[rows], weight, bias, conv_state, ssm_state, page_ids, fresh)
            for i in decode:                              # a prompt's last token on a block boundary
                for page in snapshots[i].values():
                    conv_state[page], ssm_state[page] = conv_state[pages[i]], ssm_state[pages[i]]
        for i, n in enumerate(query_lens):
            if n > 1:
                rows = slice(starts[i], starts[i] + n)
                y[rows] = self._prefill(xBC[rows], dt[rows], weight, bias, conv_state, ssm_state, pages[i],
                                        has_state[i], snapshots[i])

        y = self.norm(y.reshape(x.shape[0], -1), gate)
        return self.out_proj(y.to(x.dtype))

    def _prefill(self, xBC, dt, weight, bias, conv_state, ssm_state, page: int, has_state: bool,
                 snapshots: dict[int, int]) -> torch.Tensor:
        """One request's T > 1 rows through the convolution and the chunked scan; its page (and its snapshot
        pages) updated."""
        conv0 = conv_state[page] if has_state else torch.zeros_like(conv_state[page])
        ssm0 = ssm_state[page] if has_state else torch.zeros_like(ssm_state[page])
        out, conv_state[page] = causal_conv1d(xBC, weight, bias, conv0)    # written in place
        x, B, C = self._split(F.silu(out), per_head=False)
        y, ssm_state[page], kept = ssd_chunked(x, dt, -torch.exp(self.A_log.float()), B, C, self.D.float(),
                                               self.shape.scan_chunk, ssm0, tuple(snapshots))
        window = torch.cat([conv0.t(), xBC])                           # the conv state after t rows: window[t:t+K-1]
        for rows, snapshot in snapshots.items():
            conv_state[snapshot], ssm_state[snapshot] = window[rows:rows + conv0.shape[1]].t(), kept[rows]
        return y

    def _decode(self, xBC, dt, weight, bias, conv_state, ssm_state, page_ids: torch.Tensor,
                fresh: torch.Tensor) -> torch.Tensor:
        """R requests' single rows at once through the convolution and the recurrence; their pages updated
        (`fresh` rows start from zero: a one-token prompt)."""
        # indexing by a list of pages reads copies; assigning to it writes the pages in place
        x, B, C = self._split(self.conv_step(xBC, weight, bias, conv_state, page_ids, fresh))
        return self.decode_step(x, dt, -torch.exp(self.A_log.float()), B, C, self.D.float(), ssm_state, page_ids, fresh)

    def _split(self, xBC: torch.Tensor, per_head: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, conv_dim) -> x (rows, H, P) and B, C (rows, G, N) per group, or (rows, H, N): each group's
        B and C given to its heads (the one-token step's layout)."""
        s = self.shape
        x, B, C = xBC.split([s.intermediate_size, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        B, C = (t.reshape(-1, s.n_groups, s.state_size) for t in (B, C))
        if per_head:
            B, C = (t.repeat_interleave(s.num_heads // s.n_groups, dim=1) for t in (B, C))
        return x.reshape(-1, s.num_heads, s.head_dim), B, C

    def _check_step(self, x, conv_state, query_lens, pages) -> None:
        """The step's layout, checked before any work: one page per request, distinct, rows adding up."""
        if len(query_lens) != len(pages):
            raise ValueError(f"{len(query_lens)} query_lens but {len(pages)} pages: one page per request")
        if any(n < 1 for n in query_lens):
            raise ValueError(f"query_lens={query_lens}: every request in a step needs at least 1 row")
        if sum(query_lens) != x.shape[0]:
            raise ValueError(f"query_lens add up to {sum(query_lens)} rows but x has {x.shape[0]}")
        if len(set(pages)) != len(pages) or any(not 0 <= p < conv_state.shape[0] for p in pages):
            raise ValueError(f"pages={pages} must be distinct and in [0, {conv_state.shape[0]})")
