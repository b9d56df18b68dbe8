"""The projection factory: one call per projection in a model's layer
description, and the factory chooses how its matrix is held and multiplied.

A checkpoint offers each weight in the forms its file allows (dense; 4-bit,
up to 6-bit or 8-bit codes; an F16/BF16 file's 16 bits: Checkpoint.int4,
int6, int8, w16); which of those a model may run depends on the device, the
kernel set and the activations (`ProjectionFactory.__init__`). Fused
projections (Q, K and V in one matrix; gate and up in another) are stacked
by rows; where their types differ, one fused matrix per run of alike types,
side by side (`StackedProjection`). A family's file never sees any of this
(models/family.py)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from trioserve.kernels.int4 import Int4Parts, concat_rows
from trioserve.kernels.int6 import Int6Parts, concat_rows6
from trioserve.kernels.int8w import Int8Parts, concat_rows8
from trioserve.kernels.ops import Kernels
from trioserve.kernels.projection import DenseLater, Projection, StackedProjection
from trioserve.kernels.w16 import W16Parts, concat_rows16


class ProjectionFactory:
    """Builds a model's projections from a checkpoint's weights, on ``device``
    in ``dtype``, through ``kernels``."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        kernels: Kernels,
        device: torch.device,
        dtype: torch.dtype,
        *,
        int4: Mapping[str, Int4Parts] | None = None,
        int6: Mapping[str, Int6Parts] | None = None,
        int8: Mapping[str, Int8Parts] | None = None,
        w16: Mapping[str, W16Parts] | None = None,
    ) -> None:
        self.weights, self.kernels, self.device, self.dtype = weights, kernels, device, dtype
        on_cpu_kernels = device.type == "cpu" and kernels.name != "triton"
        # Codes of up to 6 bits (kernels/int6.py) and signed 8-bit ones (kernels/int8w.py)
        # run only with int8 activations, on a CPU.
        codes_q8 = kernels.activations == "int8" and on_cpu_kernels
        self.codes_q8 = codes_q8
        self.int4 = int4 or {}
        self.int6 = (int6 or {}) if codes_q8 else {}
        self.int8 = (int8 or {}) if codes_q8 else {}
        # 16-bit float weights (kernels/w16.py) run on a CPU, whatever the activations.
        self.w16 = (w16 or {}) if on_cpu_kernels else {}
        self._on_cpu_kernels = on_cpu_kernels

    def tensor(self, name: str) -> torch.Tensor:
        """Weight ``name`` dense, on the model's device."""
        return self.weights[name].to(self.device).contiguous()

    def kind(self, name: str) -> str:
        """How weight ``name`` is held: int4, int6, int8, w16 or dense."""
        if name in self.int4:
            return "int4"
        return "int6" if name in self.int6 else "int8" if name in self.int8 else "w16" if name in self.w16 else "dense"

    def codes(self, name: str):
        """Weight ``name``'s codes (4-, up to 6- or 8-bit) where the model runs them, else None."""
        return next((table[name] for table in (self.int4, self.int6, self.int8) if name in table), None)

    def __call__(self, names: list[str], bias_names: list[str] | None = None) -> Projection | StackedProjection:
        """One matrix from ``names`` stacked by rows (a fused projection); where
        their types differ (a mixed-type file), one fused matrix per run of
        alike, side by side."""
        runs: list[list[int]] = []
        for i, n in enumerate(names):
            if runs and self.kind(names[runs[-1][0]]) == self.kind(n):
                runs[-1].append(i)
            else:
                runs.append([i])
        if len(runs) == 1:
            return self._fused(names, bias_names)
        return StackedProjection(
            [self._fused([names[i] for i in run], [bias_names[i] for i in run] if bias_names else None) for run in runs]
        )

    def _fused(self, names: list[str], bias_names: list[str] | None) -> Projection:
        bias = torch.cat([self.tensor(n) for n in bias_names]) if bias_names else None
        kind = self.kind(names[0])
        parts = None
        if kind == "int4":
            parts = concat_rows([self.int4[n] for n in names])
        elif kind == "int6":
            parts = concat_rows6([self.int6[n] for n in names])
        elif kind == "int8":
            parts = concat_rows8([self.int8[n] for n in names])
        elif kind == "w16":
            parts = concat_rows16([self.w16[n] for n in names])

        def dense() -> torch.Tensor:
            return torch.cat([self.tensor(n) for n in names]).contiguous()

        if parts is not None and self._on_cpu_kernels:
            # Made only if a path reads the dense values (kernels/projection.DenseLater).
            return self.kernels.projection(DenseLater(parts.shape, self.dtype, self.device, dense), bias, parts)
        return self.kernels.projection(dense(), bias, parts)
