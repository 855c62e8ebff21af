"""The feature consistency gate: does the candidate's preprocessing feed the model what the champion's did?

DESIGN section 5: on a sample of images (1000 by default, chosen with ``sample_indices``), the 5th
percentile of cosine(champion features, candidate features) must be >= 0.999. The features are the
model's inputs, the preprocessed tensors flattened per image, so a changed resize, channel order or
normalisation shows up before a model is trained on inputs that serving would not reproduce.

Cosine sees direction, not length: a change that rescales every feature by one factor (the same
``std`` multiplied on every channel) passes this gate; its effect on accuracy is the eval gate's.

Specs with different channel counts (colour "L", one grey channel, against "RGB"/"BGR") are not
compared at all: their features live in different spaces, and no champion's weights could take the
candidate's inputs. The gate fails with a "channels" check that says so; such a model is a new model,
not a new version of the champion.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from serving.preprocessing import PreprocessSpec, preprocess
from tasks.verdicts import Check, GateVerdict

GATE = "feature"
# Images preprocessed at once: bounds memory (two float32 tensors per chunk) whatever the sample size.
CHUNK = 64
# Lowest-cosine images named in a failed check, so the report points at examples.
WORST_SHOWN = 3

CandidateFn = Callable[[list[npt.NDArray[np.uint8]]], npt.NDArray[Any]]


def sample_indices(n: int, k: int, seed: int) -> list[int]:
    """A deterministic sample of ``min(n, k)`` distinct indices in ``range(n)``, in ascending order.

    Ranked by a hash of (seed, index) rather than drawn from a numpy generator, whose streams may change
    between numpy versions: the same seed picks the same images on any machine, and growing ``n`` or
    ``k`` keeps the indices already picked (apart from those displaced by new, lower-ranked ones).

    Raises:
        ValueError: ``n`` or ``k`` is negative.
    """
    if n < 0 or k < 0:
        raise ValueError(f"sample_indices needs n >= 0 and k >= 0, got n={n}, k={k}")
    if k >= n:
        return list(range(n))

    def rank(index: int) -> bytes:
        return hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()

    return sorted(heapq.nsmallest(k, range(n), key=rank))


def feature_gate(
    images: Sequence[npt.NDArray[np.uint8]],
    champion: PreprocessSpec | None,
    candidate: PreprocessSpec,
    *,
    percentile: float = 5.0,
    min_cosine: float = 0.999,
    candidate_fn: CandidateFn | None = None,
) -> GateVerdict:
    """Compare the features the champion's and the candidate's preprocessing make from the same images.

    Args:
        images: the sample, uint8 RGB ``(H, W, 3)`` arrays (sizes may differ) or one ``(N, H, W, 3)`` array.
        champion: the serving model's spec; None for the first model, which passes and is recorded.
        candidate: the new model's spec.
        percentile: which percentile of the per-image cosines is held to ``min_cosine``.
        min_cosine: the bound.
        candidate_fn: a candidate preprocessing implementation under test: it turns a chunk of images into
            candidate features, ``(n, candidate.channels, height, width)``, instead of
            ``preprocess(chunk, candidate)``.

    Returns:
        The verdict: checks "first model", "channels", "output shape", "sample size" or
        "cosine p<percentile>", with the cosine summary and both specs in its metrics.

    Raises:
        ValueError: ``percentile`` or ``min_cosine`` out of range, or ``candidate_fn`` returning a
            different number of images than it was given.
    """
    if not 0.0 <= percentile <= 100.0:
        raise ValueError(f"feature gate percentile must be in [0, 100], got {percentile}")
    if not -1.0 <= min_cosine <= 1.0:
        raise ValueError(f"feature gate min_cosine must be in [-1, 1], got {min_cosine}")
    if champion is None:
        first = Check("first model", "no champion", "-", True, detail="candidate spec recorded as the baseline")
        return GateVerdict(GATE, (first,), {"champion_spec": None, "candidate_spec": candidate.to_dict()})

    metrics: dict[str, Any] = {"champion_spec": champion.to_dict(), "candidate_spec": candidate.to_dict()}
    if candidate_fn is not None:
        metrics["candidate_fn"] = getattr(candidate_fn, "__qualname__", repr(candidate_fn))
    if candidate.channels != champion.channels:
        return _channels_failure(champion, candidate, metrics)
    expected = (champion.channels, champion.height, champion.width)
    if candidate_fn is None and (candidate.channels, candidate.height, candidate.width) != expected:
        return _shape_failure(expected, (candidate.channels, candidate.height, candidate.width), metrics)
    if len(images) == 0:
        empty = Check("sample size", 0, ">= 1", False, detail="no images to compare features on")
        return GateVerdict(GATE, (empty,), {**metrics, "count": 0})

    chunks: list[npt.NDArray[np.float64]] = []
    for start in range(0, len(images), CHUNK):
        chunk = list(images[start : start + CHUNK])
        old = preprocess(chunk, champion)
        new = preprocess(chunk, candidate) if candidate_fn is None else np.asarray(candidate_fn(chunk))
        if len(new) != len(old):
            raise ValueError(f"candidate_fn returned {len(new)} feature rows for {len(old)} images")
        if new.shape != old.shape:
            return _shape_failure(expected, tuple(new.shape[1:]), metrics)
        chunks.append(_cosines(old, new))
    cosines = np.concatenate(chunks)
    return _verdict(cosines, percentile, min_cosine, metrics)


def _cosines(old: npt.NDArray[Any], new: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Per-image cosine, in float64 so summation error stays far below the 1e-3 the bound leaves.

    An all-zero feature vector has no direction: two of them count as identical (1), one as unrelated (0).
    """
    a = old.reshape(len(old), -1).astype(np.float64)
    b = new.reshape(len(new), -1).astype(np.float64)
    dots = np.einsum("ij,ij->i", a, b)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = ~a.any(axis=1) & ~b.any(axis=1)
    safe = np.where(norms > 0, norms, 1.0)
    cosines = np.where(norms > 0, dots / safe, np.where(both_zero, 1.0, 0.0))
    return np.clip(cosines, -1.0, 1.0)  # rounding can land a hair above 1; NaN stays NaN


def _verdict(
    cosines: npt.NDArray[np.float64], percentile: float, min_cosine: float, metrics: dict[str, Any]
) -> GateVerdict:
    observed = float(np.percentile(cosines, percentile))
    passed = bool(observed >= min_cosine)  # NaN (a broken candidate_fn) fails
    detail = ""
    if not passed:
        worst = np.argsort(cosines, kind="stable")[:WORST_SHOWN]
        shown = ", ".join(f"image {int(i)} ({cosines[i]:.6f})" for i in worst)
        below = int(np.count_nonzero(~(cosines >= min_cosine)))
        detail = f"{below} of {len(cosines)} images below {min_cosine}; lowest: {shown}"
    check = Check(f"cosine p{percentile:g}", observed, f">= {min_cosine}", passed, detail)
    summary = {
        "count": len(cosines),
        "cosine_min": float(np.min(cosines)),
        "cosine_median": float(np.median(cosines)),
        "cosine_mean": float(np.mean(cosines)),
    }
    return GateVerdict(GATE, (check,), {**metrics, **summary})


def _channels_failure(champion: PreprocessSpec, candidate: PreprocessSpec, metrics: dict[str, Any]) -> GateVerdict:
    # Not a cosine below the bound but no cosine at all: say what to do instead of retrying.
    check = Check(
        "channels",
        f"candidate {candidate.channels} ({candidate.colour})",
        f"== champion {champion.channels} ({champion.colour})",
        False,
        detail=(
            f"the candidate's preprocessing has {candidate.channels} channel(s) (colour {candidate.colour!r}), "
            f"the champion's {champion.channels} (colour {champion.colour!r}): their features are not comparable. "
            "A model with another colour is a new model; push it under a new dataset name, or set its model "
            f"spec's preprocessing.colour to {champion.colour!r} to keep the champion's inputs"
        ),
    )
    return GateVerdict(GATE, (check,), metrics)


def _shape_failure(champion: tuple[int, ...], candidate: tuple[int, ...], metrics: dict[str, Any]) -> GateVerdict:
    # Cosine between tensors of different sizes means nothing: the model's input contract itself changed.
    check = Check(
        "output shape",
        f"candidate {candidate}",
        f"== champion {champion}",
        False,
        detail=f"champion features are {champion}, candidate features are {candidate} (C, H, W)",
    )
    return GateVerdict(GATE, (check,), metrics)
