"""Pipeline parallelism with schedules as data.

A schedule is a value: per rank, its list of actions (``2F0`` = stage 2, forward,
micro-batch 0), bubbles as ``None``. Generate one (:mod:`.schedules`), check it without a
model (:mod:`.checker`), draw it (:mod:`.picture`), and run it (:mod:`.runtime`) on any
``collectives.ProcessGroup``::

    from parallel.pp import PipelineStage, Schedule1F1B, split_sequential
    stage = PipelineStage(split_sequential(model, pg.size)[pg.rank], pg, pg.rank, pg.size)
    losses = Schedule1F1B(stage, 4, F.cross_entropy).step(x, target=y)
"""

from .actions import Action, parse_action, stage_rank
from .checker import ScheduleError, check_schedule, simulate
from .lowering import lower
from .picture import draw_png, text_grid, timeline_from_trace
from .runtime import (PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                      ScheduleZeroBubble)
from .schedules import (SCHEDULES, bubble_fraction, gpipe, interleaved_1f1b, one_f_one_b,
                        timed, zb_h1)
from .split import split_sequential
from .timing import idle_fraction, pipeline_bubble, replay
from .stage import PipelineStage

__all__ = ["Action", "PipelineSchedule", "PipelineStage", "SCHEDULES", "Schedule1F1B",
           "ScheduleError", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleZeroBubble",
           "bubble_fraction", "check_schedule", "draw_png", "gpipe", "idle_fraction",
           "interleaved_1f1b", "lower", "one_f_one_b", "parse_action", "pipeline_bubble",
           "replay", "simulate",
           "split_sequential", "stage_rank", "text_grid", "timed", "timeline_from_trace",
           "zb_h1"]
