"""Faults a simulated instance can be told to have, for tests of failure isolation and restarts.

A latency profile may carry them (`"faults": {...}` in its JSON); a profile fitted by `strata
profile` has none. They are simulated hardware and model faults, raised from the executor's step
as a real one would raise them:

    poison_seed      a sequence whose request has this `seed` fails (a request the model cannot
                     run: the engine fails it alone, the others go on)
    fail_from_step   every step from this one on (1-based) fails (a lost device: the engine
                     stops and `strata serve` exits non-zero)
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.engine.executor import ModelInput
from strata.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SimFaults:
    poison_seed: int | None = None
    fail_from_step: int | None = None

    def __post_init__(self) -> None:
        if self.fail_from_step is not None and self.fail_from_step < 1:
            raise ConfigError(f"faults.fail_from_step must be >= 1, got {self.fail_from_step}")

    @property
    def is_none(self) -> bool:
        return self.poison_seed is None and self.fail_from_step is None

    def check(self, step: int, model_input: ModelInput) -> None:
        """Raise as the faulty hardware would on `step` (1-based) over `model_input`."""
        if self.fail_from_step is not None and step >= self.fail_from_step:
            raise RuntimeError(f"simulated fault: the device is lost (step {step})")
        if self.poison_seed is None:
            return
        for seq in model_input.sequences:
            if seq.sampling_params.seed == self.poison_seed:
                raise RuntimeError(f"simulated fault: request {seq.request_id} cannot run")


__all__ = ["SimFaults"]
