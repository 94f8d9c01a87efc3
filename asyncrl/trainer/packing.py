"""Sequence packing: variable-length sequences into micro-batches under a token budget.

Every stage hands the trainer core a list of ``TokenSequence`` (token ids plus per-token
fields aligned with them). This module splits a global batch across ranks with balanced
token counts and packs each rank's share into micro-batches by first-fit decreasing. A
packed micro-batch is a few rows, each several sequences concatenated with position ids
restarting at 0, which transformers turns into a block-diagonal causal mask (with no
cache and no attention mask), so no token attends across a sequence boundary. Short rows
keep the quadratic attention cost low. The ``padded`` layout exists as a baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenSequence:
    """One training sequence; every per-token list has ``len(input_ids)`` entries.

    ``loss_mask[t] = 1`` means token ``t`` is a target, predicted from the logits at
    ``t - 1``; token 0 is never a target (it has nothing before it).
    """

    input_ids: list[int]
    loss_mask: list[int]
    fields: dict[str, list[float]] = field(default_factory=dict)
    """Extra per-token values (advantages, behavior logprobs, versions …)."""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class MicroBatch:
    """Tensors of one forward pass, each ``[rows, L]``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None
    """None when packed (the block-diagonal mask comes from position ids); ``[rows, L]``
    when padded."""
    fields: dict[str, torch.Tensor]
    seq_lens: list[int]
    """Lengths of the sequences in the order they appear."""
    sequence_ids: torch.Tensor | None = None
    """``[rows, L]`` long: which sequence (its index in ``seq_lens``) each token belongs
    to, -1 on padding. Per-sequence quantities (a DPO logprob sum, a reward model's score)
    are read through it."""

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    def to(self, device: torch.device) -> MicroBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            loss_mask=move(self.loss_mask),
            attention_mask=move(self.attention_mask),
            fields={k: move(v) for k, v in self.fields.items()},
            seq_lens=self.seq_lens,
            sequence_ids=move(self.sequence_ids),
        )

    def sequence_sums(self, values: torch.Tensor) -> torch.Tensor:
        """``[S]``: the sum of ``values`` (``[rows, L]``) over each sequence's tokens."""
        assert self.sequence_ids is not None
        ids = self.sequence_ids.reshape(-1)
        real = ids >= 0
        out = values.new_zeros(len(self.seq_lens))
        return out.index_add(0, ids[real], values.reshape(-1)[real])

    def last_token(self, values: torch.Tensor) -> torch.Tensor:
        """``[S]``: ``values`` (``[rows, L]``) at each sequence's last token."""
        assert self.sequence_ids is not None
        ids = self.sequence_ids
        # A token is its sequence's last when the next token belongs to another one.
        nxt = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-1)
        last = (ids >= 0) & (nxt != ids)
        order = ids[last]  # sequence index of each last token, in row-major order
        out = values.new_zeros(len(self.seq_lens))
        return out.index_copy(0, order, values[last])


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped into bins whose summed length fits ``budget``.

    A sequence longer than the budget gets a bin of its own. Deterministic: ties keep
    the original order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def split_balanced(lengths: list[int], parts: int) -> list[list[int]]:
    """Assign indices to ``parts`` groups with balanced token sums (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in order:
        g = min(range(parts), key=lambda p: (totals[p], len(groups[p]), p))
        groups[g].append(i)
        totals[g] += lengths[i]
    return [sorted(g) for g in groups]


def _collate_rows(rows: list[list[TokenSequence]], pad_id: int, with_mask: bool) -> MicroBatch:
    """Rows of concatenated sequences, tail-padded to the longest row.

    Position ids restart at 0 for every sequence and for the padding tail, so without an
    attention mask each sequence (and the padding) is its own causal block.
    """
    width = max(sum(len(s) for s in row) for row in rows)
    names = list(rows[0][0].fields)
    ids, pos, mask, attn, seq_ids = [], [], [], [], []
    fields: dict[str, list] = {n: [] for n in names}
    count = 0
    for row in rows:
        tail = width - sum(len(s) for s in row)
        seq_ids.append([count + i for i, s in enumerate(row) for _ in s.input_ids] + [-1] * tail)
        count += len(row)
        ids.append([t for s in row for t in s.input_ids] + [pad_id] * tail)
        pos.append([p for s in row for p in range(len(s))] + list(range(tail)))
        mask.append([m for s in row for m in s.loss_mask] + [0] * tail)
        attn.append([1] * (width - tail) + [0] * tail)
        for n in names:
            fields[n].append([x for s in row for x in s.fields[n]] + [0.0] * tail)
    return MicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        attention_mask=torch.tensor(attn, dtype=torch.long) if with_mask else None,
        fields={n: torch.tensor(v, dtype=torch.float32) for n, v in fields.items()},
        seq_lens=[len(s) for row in rows for s in row],
        sequence_ids=torch.tensor(seq_ids, dtype=torch.long),
    )


def make_micro_batches(
    seqs: list[TokenSequence],
    budget: int,
    layout: str = "packed",
    pad_id: int = 0,
    row_tokens: int = 256,
    group_size: int = 1,
) -> list[MicroBatch]:
    """Group ``seqs`` into micro-batches of at most ``budget`` tokens (rows × width).

    ``packed``: sequences are packed first-fit decreasing into rows of ``row_tokens``
    (attention cost grows with the square of a row, so rows stay short and many), then
    rows are stacked into micro-batches. ``padded``: one sequence per row, in arrival
    order, padded to the longest in its micro-batch with an attention mask: the usual
    layout, kept as the baseline.

    ``group_size`` > 1 keeps each run of that many consecutive sequences together, in
    their order: in one row when packed, in consecutive rows of one micro-batch when
    padded. A preference pair (chosen, rejected) is such a group, so its loss is computed
    within one micro-batch from consecutive entries of ``seq_lens``.
    """
    if not seqs:
        return []
    if len(seqs) % group_size:
        raise ValueError(f"{len(seqs)} sequences do not split into groups of {group_size}")
    for s in seqs:
        if len(s) < 2 or s.loss_mask[0]:
            raise ValueError("a sequence needs at least 2 tokens and no target at position 0")
    units = [seqs[i : i + group_size] for i in range(0, len(seqs), group_size)]
    if layout == "packed":
        bins = first_fit_decreasing([sum(len(s) for s in u) for u in units], row_tokens)
        rows = [[s for i in sorted(b) for s in units[i]] for b in bins]
        rows.sort(key=lambda r: -sum(len(s) for s in r))  # widest first: little tail padding
        blocks = [[row] for row in rows]
    elif layout == "padded":
        # arrival order, as a plain padded data loader has it
        blocks = [[[s] for s in u] for u in units]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    groups: list[list[list[TokenSequence]]] = [[]]
    for block in blocks:
        group = groups[-1]
        width = max([sum(len(s) for s in r) for r in group + block])
        if group and (len(group) + len(block)) * width > budget:
            groups.append([])
        groups[-1].extend(block)
    return [_collate_rows(g, pad_id, with_mask=layout == "padded") for g in groups]


def dummy_micro_batch(pad_id: int, field_names: list[str]) -> MicroBatch:
    """A two-token micro-batch with no targets, run by a rank that has fewer micro-batches
    than its peers so every rank joins the same number of FSDP collectives."""
    seq = TokenSequence([pad_id, pad_id], [0, 0], {n: [0.0, 0.0] for n in field_names})
    return _collate_rows([[seq]], pad_id, with_mask=False)
