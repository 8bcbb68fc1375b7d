"""`StepInputs`: a step's plan as the host integers the forward pass and sampling need, built in
one place.

`StepInputs.from_plan` walks the plan's segments once for the flat batch (token ids, positions,
the rows whose logits are sampled and the row each draw reads) and hands the same segments to
`engine.attention.base.StepLayout` for what attention needs (slots, block tables, context
lengths, prefill pieces). The model runner uploads all of them in one host-to-device copy
(`engine.attention.base.build_metadata`); the CUDA-graph path pads them to a graph's shape
(`engine.runner.cuda_graphs.pad_decode_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.attention.base import StepLayout
from engine.core.plan import StepPlan
from engine.runner.sampler import greedy_split


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One step's flat batch as host integers.

    Attributes:
        token_ids: [T] the tokens of each segment, in plan order (decode rows first).
        positions: [T] each token's position in its request.
        sample_rows: [R] the flat-batch row of each sampling segment's last token (one logits row
            each).
        draw_rows: [D] for each draw (`StepPlan.draws`, in order), the logits row it samples
            from (n > 1 draws share their prompt's row).
        greedy_draws / drawn_draws: the draws sampled greedily (temperature 0) and the others,
            as indices into the D draws (`engine.runner.sampler.greedy_split`).
        layout: the attention layout of the same segments (KV group 0's block tables).
        group_layouts: the layouts of KV groups 1 .. G - 1 (`Segment.group_tables`; empty for a
            model of one group): the same tokens and positions, the group's own blocks.
    """

    token_ids: list[int]
    positions: list[int]
    sample_rows: list[int]
    draw_rows: list[int]
    greedy_draws: list[int]
    drawn_draws: list[int]
    layout: StepLayout
    group_layouts: tuple[StepLayout, ...] = ()

    @classmethod
    def from_plan(cls, plan: StepPlan, block_size: int) -> "StepInputs":
        """The inputs of `plan` over blocks of `block_size` tokens.

        Raises:
            ValueError: a block table does not cover its segment, or a decode row follows a
                prefill piece (`StepLayout.from_segments`).
        """
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for seg in plan.segments:
            req = seg.request
            token_ids.extend(req.token_at(p) for p in range(seg.start, seg.end))
            positions.extend(range(seg.start, seg.end))
            if seg.samples:
                sample_rows.append(len(token_ids) - 1)
        layout = StepLayout.from_segments(
            [(s.start, s.length, s.block_table, s.decode) for s in plan.segments], block_size)
        groups = len(plan.segments[0].group_tables) if plan.segments else 0
        group_layouts = tuple(StepLayout.from_segments(
            [(s.start, s.length, s.group_tables[g], s.decode) for s in plan.segments], block_size)
            for g in range(groups))
        greedy, drawn = greedy_split([req.sampling for _, req in plan.draws])
        return cls(token_ids, positions, sample_rows, [row for row, _ in plan.draws], greedy,
                   drawn, layout, group_layouts)

    @property
    def sampling_ints(self) -> list[list[int]]:
        """What the logits and sampling stages read, uploaded with the step's other integers:
        [sample_rows, draw_rows, greedy_draws, drawn_draws]."""
        return [self.sample_rows, self.draw_rows, self.greedy_draws, self.drawn_draws]

    @property
    def decode_only(self) -> bool:
        """True when the step holds decode rows and no prefill piece."""
        return bool(self.token_ids) and not self.layout.pieces

    @property
    def draws_share_rows(self) -> bool:
        """True when some logits row is sampled more than once (the first tokens of n > 1)."""
        return self.draw_rows != list(range(len(self.sample_rows)))
