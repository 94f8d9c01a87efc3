"""Sequence packing: variable-length sequences into micro-batches under a token budget.

Every stage hands the trainer core a list of ``TokenSequence`` (token ids plus per-token
fields aligned with them). This module splits a global batch across ranks with balanced
token counts and packs each rank's share into micro-batches by first-fit decreasing. A
packed micro-batch is a few rows, each several sequences concatenated with position ids
restarting at 0, which transformers turns into a block-diagonal causal mask (with no
cache and no attention mask), so no token attends across a sequence boundary. Short rows
keep the quadratic attention cost low. The ``padded`` layout exists as a baseline.

With ``share_prefix`` a group (GRPO's n samples of one prompt) is laid out as a tree: the
prompt once, then each completion, with position ids continuing from the prompt, a 4D
mask that lets a completion see the prompt and itself only, and ``parents``: the logits
predicting a completion's first token are the prompt's last. ``TrainerCore.forward``
realigns the logits so every loss reads them as in the flat layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

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
    are read through it. A shared prefix belongs to its group's first sequence."""
    parents: torch.Tensor | None = None
    """``[rows, L]`` long, with a shared prefix only: the position in the row of the logits
    that predict each token (``t - 1``, except a completion's first token, predicted at
    the prompt's last). None: ``t - 1`` everywhere."""

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
            parents=move(self.parents),
        )

    @property
    def forward_tokens(self) -> int:
        """Positions the forward computes, padding aside: less than ``num_tokens`` when a
        prefix is shared."""
        if self.sequence_ids is None:
            return self.num_tokens
        return int((self.sequence_ids >= 0).sum())

    def align_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[rows, L, V]`` logits of a forward over this micro-batch, moved so that position
        ``t`` holds the logits that predict token ``t + 1``, as in a flat row: every loss
        then reads them the same way whatever the layout. Unchanged without ``parents``."""
        if self.parents is None:
            return logits
        # the last position predicts nothing; it keeps its own logits
        last = self.parents.new_full((self.parents.shape[0], 1), self.parents.shape[1] - 1)
        index = torch.cat([self.parents[:, 1:], last], dim=1)
        return logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))

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


@dataclass
class _Unit:
    """Sequences laid out together in one row: their first ``prefix`` tokens once, then
    each one's remaining tokens (``prefix`` 0: the sequences one after another)."""

    members: list[TokenSequence]
    prefix: int = 0

    def __len__(self) -> int:
        return self.prefix + sum(len(s) - self.prefix for s in self.members)


def shared_prefix(members: list[TokenSequence]) -> int:
    """Length of the prefix a group can share: tokens equal in every member, none of them
    a target, and at least one token of each member left after it."""
    if len(members) < 2:
        return 0
    limit = min(len(s) for s in members) - 1
    first = members[0]
    n = 0
    while (
        n < limit
        and not first.loss_mask[n]
        and all(s.input_ids[n] == first.input_ids[n] and not s.loss_mask[n] for s in members[1:])
    ):
        n += 1
    return n


@dataclass
class _RowTokens:
    """One row's per-token lists before the padding tail, all of one length."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    """Index of each token's sequence in the micro-batch."""
    parents: list[int] = field(default_factory=list)
    """Position in the row of the logits that predict each token."""
    unit: list[int] = field(default_factory=list)
    """Index of each token's unit in the micro-batch."""
    branch: list[int] = field(default_factory=list)
    """0 for a shared prefix, else 1 + the member's index in its unit."""
    fields: dict[str, list[float]] = field(default_factory=dict)


def _lay_out_row(row: list[_Unit], names: list[str], count: int, units: int) -> _RowTokens:
    """The tokens of one row's units; ``count`` sequences and ``units`` units precede it."""
    r = _RowTokens(fields={n: [] for n in names})
    for unit in row:
        p, head = unit.prefix, unit.members[0]
        start = len(r.ids)
        for branch, s in enumerate([None, *unit.members]):
            # branch 0 is the shared prefix (taken from the first member)
            lo, hi, src = (0, p, head) if s is None else (p, len(s), s)
            r.ids += src.input_ids[lo:hi]
            r.pos += range(lo, hi)
            r.mask += src.loss_mask[lo:hi]
            r.seq += [count + max(branch - 1, 0)] * (hi - lo)
            first = len(r.parents)
            r.parents += range(first - 1, first - 1 + hi - lo)
            if s is not None and p and hi > lo:
                r.parents[first] = start + p - 1  # predicted at the prompt's last token
            elif hi > lo and lo == 0:
                r.parents[first] = first  # a sequence's first token: nothing predicts it
            r.unit += [units] * (hi - lo)
            r.branch += [branch] * (hi - lo)
            for n in names:
                r.fields[n] += src.fields[n][lo:hi]
        count += len(unit.members)
        units += 1
    return r


def _collate_rows(rows: list[list[_Unit]], pad_id: int, layout: str) -> MicroBatch:
    """Rows of concatenated units, tail-padded to the longest row.

    Position ids restart at 0 for every sequence and for the padding tail, so without an
    attention mask each sequence (and the padding) is its own causal block. A unit with a
    shared prefix continues its members' position ids after the prefix; the ``tree``
    layout then carries a 4D mask and ``parents``.
    """
    width = max(sum(len(u) for u in row) for row in rows)
    names = list(rows[0][0].members[0].fields)
    ids, pos, mask, attn, seq_ids, parents, unit_ids, branches = ([] for _ in range(8))
    fields: dict[str, list] = {n: [] for n in names}
    count = units = 0
    for row in rows:
        r = _lay_out_row(row, names, count, units)
        count += sum(len(unit.members) for unit in row)
        units += len(row)
        tail = width - len(r.ids)
        ids.append(r.ids + [pad_id] * tail)
        pos.append(r.pos + list(range(tail)))
        mask.append(r.mask + [0] * tail)
        attn.append([1] * len(r.ids) + [0] * tail)
        seq_ids.append(r.seq + [-1] * tail)
        parents.append(r.parents + list(range(len(r.parents), width)))
        unit_ids.append(r.unit + [-1] * tail)
        branches.append(r.branch + [0] * tail)
        for n in names:
            fields[n].append(r.fields[n] + [0.0] * tail)
    attention_mask = None
    if layout == "padded":
        attention_mask = torch.tensor(attn, dtype=torch.long)
    elif layout == "tree":
        attention_mask = _tree_mask(torch.tensor(unit_ids), torch.tensor(branches))
    return MicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        attention_mask=attention_mask,
        fields={n: torch.tensor(v, dtype=torch.float32) for n, v in fields.items()},
        seq_lens=[len(s) for row in rows for u in row for s in u.members],
        sequence_ids=torch.tensor(seq_ids, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long) if layout == "tree" else None,
    )


def _tree_mask(unit: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``[rows, 1, L, L]`` bool, True where query q may attend to key k: same unit (the
    padding tail is one), k not after q, and k in the shared prefix or q's own branch."""
    # [rows, L, 1] against [rows, 1, L]: queries along dim 1, keys along dim 2
    same_unit = unit.unsqueeze(2) == unit.unsqueeze(1)
    key_branch = branch.unsqueeze(1)
    visible = (key_branch == 0) | (key_branch == branch.unsqueeze(2))
    causal = torch.ones(unit.shape[1], unit.shape[1], dtype=torch.bool).tril()
    return (same_unit & causal & visible).unsqueeze(1)


def _row_blocks(
    groups: list[list[TokenSequence]], layout: str, row_tokens: int, share_prefix: bool
) -> list[list[list[_Unit]]]:
    """Blocks of rows that must share a micro-batch, in the order they are stacked: one
    packed row each, or one group's padded rows."""
    if layout == "packed":
        units = [
            [_Unit(g, shared_prefix(g))] if share_prefix else [_Unit([s]) for s in g]
            for g in groups
        ]
        bins = first_fit_decreasing([sum(len(u) for u in g) for g in units], row_tokens)
        rows = [[u for i in sorted(b) for u in units[i]] for b in bins]
        rows.sort(key=lambda r: -sum(len(u) for u in r))  # widest first: little tail padding
        return [[row] for row in rows]
    if layout == "padded":
        # arrival order, as a plain padded data loader has it
        return [[[_Unit([s])] for s in g] for g in groups]
    raise ValueError(f"unknown layout {layout!r}")


def make_micro_batches(
    seqs: list[TokenSequence],
    budget: int,
    layout: str = "packed",
    pad_id: int = 0,
    row_tokens: int = 256,
    group_size: int | list[int] = 1,
    share_prefix: bool = False,
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
    within one micro-batch from consecutive entries of ``seq_lens``. A list gives the
    size of each consecutive group (GRPO's groups, when some lost samples).

    ``share_prefix`` (packed only): each group's common prompt (``shared_prefix``) is
    computed once, its members' remaining tokens attending to it through a 4D mask.
    """
    if not seqs:
        return []
    sizes = group_size if isinstance(group_size, list) else [group_size] * (len(seqs) // group_size)
    if sum(sizes) != len(seqs) or min(sizes) < 1:
        raise ValueError(f"{len(seqs)} sequences do not split into groups of {group_size}")
    if share_prefix and layout != "packed":
        raise ValueError(f"share_prefix needs the packed layout, not {layout!r}")
    for s in seqs:
        if len(s) < 2 or s.loss_mask[0]:
            raise ValueError("a sequence needs at least 2 tokens and no target at position 0")
    starts = list(accumulate(sizes, initial=0))
    groups = [seqs[a : a + n] for a, n in zip(starts, sizes)]
    blocks = _row_blocks(groups, layout, row_tokens, share_prefix)
    batches: list[list[list[_Unit]]] = [[]]
    for block in blocks:
        batch = batches[-1]
        width = max([sum(len(u) for u in r) for r in batch + block])
        if batch and (len(batch) + len(block)) * width > budget:
            batches.append([])
        batches[-1].extend(block)
    collate = "tree" if share_prefix else layout
    return [_collate_rows(b, pad_id, collate) for b in batches]


def dummy_micro_batch(pad_id: int, field_names: list[str]) -> MicroBatch:
    """A two-token micro-batch with no targets, run by a rank that has fewer micro-batches
    than its peers so every rank joins the same number of FSDP collectives."""
    seq = TokenSequence([pad_id, pad_id], [0, 0], {n: [0.0, 0.0] for n in field_names})
    return _collate_rows([[_Unit([seq])]], pad_id, "packed")
