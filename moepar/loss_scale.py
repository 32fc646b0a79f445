"""Loss scaling for float16 training: torch.amp.GradScaler's dynamic rule, decided from the
global gradient norm so that every rank scales, skips and grows alike.

float16 has the range of about 6e-5 .. 65504: gradients of a language model underflow to zero
unless the loss is multiplied by a large scale before backward (and the gradients divided by it
after). The scale starts at `train.loss_scale` (2^16 by default); a step whose gradient norm is
Inf or NaN (an overflow at this scale) is skipped and the scale halves; after `growth_interval`
finite steps in a row it doubles. The norm is all-reduced over every axis before anyone decides,
so all ranks take the same decision without another collective.

With another dtype a `train.loss_scale` > 0 is a fixed scale (a power of two leaves float64
results bit-identical: the test of the plumbing).
"""

from dataclasses import dataclass

__all__ = ["LossScaler"]


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    dynamic: bool = True
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    finite_steps: int = 0          # finite steps since the scale last changed

    def update(self, finite: bool) -> str | None:
        """After a step: backs off on overflow, grows after growth_interval finite steps;
        returns a line for the log when the scale changed."""
        if not self.dynamic:
            return None
        old = self.scale
        if not finite:
            self.scale *= self.backoff_factor
            self.finite_steps = 0
            return f"loss scale {old:g} -> {self.scale:g} (gradients overflowed float16)"
        self.finite_steps += 1
        if self.finite_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.finite_steps = 0
            return f"loss scale {old:g} -> {self.scale:g} ({self.growth_interval} finite steps)"
        return None

    def state_dict(self) -> dict:
        return {"scale": self.scale, "finite_steps": self.finite_steps}

    def load_state_dict(self, state: dict):
        scale, steps = state.get("scale"), state.get("finite_steps")
        if not (isinstance(scale, (int, float)) and scale > 0 and isinstance(steps, int)
                and steps >= 0):
            raise ValueError(f"checkpoint loss scale state {state!r} is not a positive scale "
                             "and a count of steps")
        self.scale, self.finite_steps = float(scale), steps
