"""Error feedback: remember what compression dropped and add it to the next message.

One `ErrorFeedback` per link; residuals are keyed by tensor name. For a quantity that
is summed over time (gradients), the sum of what the receiver decodes then tracks the
sum of what the sender meant to send: sum(decoded) = sum(inputs) - last residual.
For activations it is not sound in the same way (each micro-batch is another sample);
see protocol/COMPRESSION.md, "Measurements", for what the benchmark found.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

DEFAULT_DECAY = 1.0  # factor applied to the residual before it is added back (1.0 = classic EF)


class ErrorFeedback:
    """Residual memory of one link: residual[name] = (input + residual) - decoded."""

    def __init__(self, decay: float = DEFAULT_DECAY) -> None:
        if not (0.0 <= decay <= 1.0):
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        self.decay = decay
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(
        self, name: str, tensor: torch.Tensor, transmit: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Send `tensor` plus the residual of `name` through `transmit` (which returns what the
        receiver decodes); keep the new residual and return the decoded tensor."""
        sent = self.compensate(name, tensor)
        decoded = transmit(sent)
        self.record(name, sent, decoded)
        return decoded

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` plus the (decayed) residual kept for `name`; a residual of another shape is dropped."""
        residual = self._residuals.get(name)
        if residual is None:
            return tensor
        if residual.shape != tensor.shape:
            logger.debug(
                "error feedback %r: shape %s -> %s, residual dropped",
                name,
                tuple(residual.shape),
                tuple(tensor.shape),
            )
            del self._residuals[name]
            return tensor
        return tensor + (residual * self.decay if self.decay != 1.0 else residual).to(tensor.dtype)

    def record(self, name: str, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep what `decoded` lacks of `sent` as the residual of `name` (in float32)."""
        self._residuals[name] = sent.detach().float() - decoded.detach().float()

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one residual, or all of them (after a re-plan moves the link)."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)
