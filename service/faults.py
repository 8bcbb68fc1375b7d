"""Fault injection for failure tests: an executor whose forward pass raises at step k.

`python -m service --fail-at-step K` (or `GENSERVE_FAIL_AT_STEP=K`, which `genserve serve`
passes on to its engine through the environment) wraps the engine's executor after start-up
calibration, so step 1 is the first forward pass that serves a client. When step K raises, the
engine loop ends every open request with an error, and the process exits non-zero (see
`service.server`), as it would on a real device fault.

`--fail-once-file PATH` (`GENSERVE_FAIL_ONCE_FILE`) makes the fault one-shot across restarts:
the fault fires only while PATH does not exist and creates it when it fires, so the engine the
supervisor restarts afterwards serves normally. Never set these in production.
"""

from __future__ import annotations

import logging
import os
import pathlib

from engine.core.outputs import SampledTokens
from engine.core.plan import StepPlan

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The error an armed `FailingExecutor` raises."""


class FailingExecutor:
    """Delegates to `inner` and raises `InjectedFault` on its `fail_at_step`-th `execute` call.

    Args:
        inner: the real executor (every other attribute is read from it).
        fail_at_step: 1-based call number that raises.
        once_file: when given, the fault fires only if this file does not exist yet, and the
            file is created when it fires.
    """

    def __init__(self, inner, fail_at_step: int, once_file: str | os.PathLike | None = None) -> None:
        if fail_at_step < 1:
            raise ValueError(f"fail_at_step must be >= 1, got {fail_at_step}")
        self.inner = inner
        self.fail_at_step = fail_at_step
        self.once_file = pathlib.Path(once_file) if once_file else None
        self.num_calls = 0
        self.armed = self.once_file is None or not self.once_file.exists()

    def execute(self, plan: StepPlan) -> SampledTokens:
        self.num_calls += 1
        if self.armed and self.num_calls == self.fail_at_step:
            self.armed = False
            if self.once_file is not None:
                self.once_file.touch()
            log.error("injected fault: forward pass %d raises", self.num_calls)
            raise InjectedFault(f"injected fault at step {self.num_calls}")
        return self.inner.execute(plan)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def fault_settings(fail_at_step: int | None, once_file: str | None,
                   environ: dict[str, str] | None = None) -> tuple[int | None, str | None]:
    """The effective (fail_at_step, once_file): flags first, then GENSERVE_FAIL_AT_STEP and
    GENSERVE_FAIL_ONCE_FILE."""
    env = os.environ if environ is None else environ
    if fail_at_step is None and env.get("GENSERVE_FAIL_AT_STEP"):
        fail_at_step = int(env["GENSERVE_FAIL_AT_STEP"])
    if once_file is None:
        once_file = env.get("GENSERVE_FAIL_ONCE_FILE") or None
    return fail_at_step, once_file
