"""Helpers shared by the kernel tests: verbose comparisons and seeded random inputs.

Every kernel test compares a Triton launcher with its torch reference on fresh random inputs. The
assertions here say *how* two tensors differ (relative error, how many elements, where, NaNs), so a
failure on a GPU run can be read without re-running it.
"""
import math

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (``||out - ref||`` when ``ref`` is all zeros).

    NaN or infinity anywhere yields ``nan`` or ``inf``, so ``rel_error(...) <= tol`` fails on them.
    """
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    diff = torch.linalg.vector_norm(out64 - ref64).item()
    ref_norm = torch.linalg.vector_norm(ref64).item()
    return diff if ref_norm == 0.0 else diff / ref_norm


def _describe(out: torch.Tensor, ref: torch.Tensor) -> str:
    return (f"out {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"ref {tuple(ref.shape)} {ref.dtype} on {ref.device}")


def _check_shapes(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape mismatch: {_describe(out, ref)}")


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, name: str) -> float:
    """Assert ``rel_error(out, ref) <= tol``; return the relative error.

    The message gives the relative error, how many elements differ by more than ``tol * max|ref|``,
    the largest elementwise difference and where it is, NaN counts and both shapes/dtypes.
    """
    _check_shapes(out, ref, name)
    err = rel_error(out, ref)
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    out_nans = int(torch.isnan(out64).sum())
    ref_nans = int(torch.isnan(ref64).sum())
    if err <= tol and out_nans == ref_nans:
        return err
    abs_diff = (out64 - ref64).abs()
    ref_max = ref64.abs().nan_to_num(0.0).max().item() if ref64.numel() else 0.0
    bad = abs_diff.nan_to_num(math.inf) > tol * ref_max
    worst = int(abs_diff.nan_to_num(math.inf).flatten().argmax()) if abs_diff.numel() else 0
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out64.shape))
    raise AssertionError(
        f"{name}: relative error {err:.3e} > tol {tol:.1e}; "
        f"{int(bad.sum())}/{out64.numel()} elements differ by more than tol*max|ref| = {tol * ref_max:.3e}; "
        f"worst at {where}: out={out64.flatten()[worst].item():.6g} ref={ref64.flatten()[worst].item():.6g}; "
        f"NaNs out={out_nans} ref={ref_nans}; {_describe(out, ref)}"
    )


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """Floating tensors as same-width integers, so that equality is bitwise (NaN == NaN, -0 != +0)."""
    if t.dtype.is_floating_point:
        return t.view(_BITS[t.element_size()])
    return t


def assert_equal(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """Assert bit-exact equality (same shape, dtype and bits); report mismatch count and first index."""
    _check_shapes(out, ref, name)
    if out.dtype != ref.dtype:
        raise AssertionError(f"{name}: dtype mismatch: {_describe(out, ref)}")
    diff = _as_bits(out.detach().cpu()) != _as_bits(ref.detach().cpu())
    n_bad = int(diff.sum())
    if n_bad == 0:
        return
    first = tuple(int(i) for i in diff.nonzero()[0])
    raise AssertionError(
        f"{name}: {n_bad}/{out.numel()} elements differ; first at {first}: "
        f"out={out.detach().cpu()[first].float().item()!r} ref={ref.detach().cpu()[first].float().item()!r}; "
        f"{_describe(out, ref)}"
    )


def generator(seed: int, device="cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Standard-normal tensor of ``shape`` drawn in float32 from ``generator(seed)``, cast to ``dtype``."""
    gen = generator(seed, device)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32, device=device).to(dtype)
