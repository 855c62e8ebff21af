"""One synthetic top-down image of two SMD solder joints (numpy only; encoding is the caller's job).

The scene is drawn in canonical units, where the unrotated image spans [-0.5, 0.5]: an IC package
along the top edge, two of its gull-wing leads resting on copper pads either side of the centre, and
the solder on each pad, whose shape is the class. Shapes are signed distance fields turned into
anti-aliased coverage, so one image costs a few dozen array operations at the target size.

Every draw comes from the generator passed in, so an image depends only on (class, generator, size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Field = NDArray[np.float32]
RGB = NDArray[np.float32]

CLASSES: tuple[str, ...] = ("good", "bridge", "insufficient", "excess")

# Solder-mask colours seen on production lines and how often; the board fills most of the frame, so
# this spread, not the joint, dominates an image's mean colour.
_BOARDS = (
    ((38, 105, 58), 0.40),  # green
    ((22, 66, 40), 0.12),  # dark green
    ((28, 62, 125), 0.17),  # blue
    ((26, 26, 30), 0.15),  # black
    ((135, 32, 32), 0.10),  # red
    ((78, 40, 98), 0.06),  # purple
)
_PAD_FINISHES = (((196, 122, 72), 0.6), ((214, 175, 92), 0.25), ((170, 100, 62), 0.15))  # copper, ENIG, OSP


@dataclass(frozen=True)
class Frame:
    """Canonical coordinates of every pixel centre, and pixels per canonical unit (for anti-aliasing)."""

    u: Field
    v: Field
    px: float


@dataclass(frozen=True)
class Layout:
    """Geometry of the two joints in canonical units; the pads sit at u = -pitch/2 and +pitch/2."""

    pitch: float
    pad_hu: float
    pad_v0: float
    pad_v1: float
    lead_hu: float
    toe: float
    body: float
    light: tuple[float, float, float]  # unit vector towards the lamp, for the convex shapes' shading
    solder: tuple[float, float, float]


def render(label: str, rng: np.random.Generator, size: tuple[int, int]) -> NDArray[np.uint8]:
    """Render one (height, width, 3) uint8 image showing ``label`` (one of ``CLASSES``)."""
    if label not in CLASSES:
        raise ValueError(f"label {label!r} is not one of {', '.join(CLASSES)}")
    frame = _frame(rng, *size)
    lay = _layout(rng)
    img = _board(rng, frame, lay)
    _joints(img, rng, frame, lay, label)
    return _camera(img, rng, frame)


def _frame(rng: np.random.Generator, width: int, height: int) -> Frame:
    # Inspection cameras are aligned with the board axes, so a quarter turn plus a little skew, not any angle.
    theta = float(rng.integers(4)) * np.pi / 2 + rng.normal(0.0, 0.07)
    zoom, scale = rng.uniform(0.88, 1.12), min(width, height)
    shift = rng.uniform(-0.05, 0.05, size=2)
    x = ((np.arange(width, dtype=np.float32) + 0.5 - width / 2) / scale - shift[0])[None, :]
    y = ((np.arange(height, dtype=np.float32) + 0.5 - height / 2) / scale - shift[1])[:, None]
    c, s = np.float32(np.cos(theta) / zoom), np.float32(np.sin(theta) / zoom)
    return Frame(u=c * x + s * y, v=c * y - s * x, px=float(scale * zoom))


def _layout(rng: np.random.Generator) -> Layout:
    pad_hu = rng.uniform(0.075, 0.095)
    elevation, azimuth = rng.uniform(0.8, 1.3), rng.uniform(0, 2 * np.pi)
    dull = rng.uniform(0.8, 1.05)
    tint = rng.normal(0, 4, 3)
    return Layout(
        pitch=rng.uniform(0.42, 0.50),
        pad_hu=pad_hu,
        pad_v0=rng.uniform(-0.16, -0.10),
        pad_v1=rng.uniform(0.26, 0.32),
        lead_hu=pad_hu * rng.uniform(0.5, 0.62),
        toe=rng.uniform(0.08, 0.16),
        body=rng.uniform(-0.34, -0.27),
        light=(np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth), np.sin(elevation)),
        solder=tuple(float(c) for c in np.array([188, 190, 194]) * dull + tint),  # type: ignore[arg-type]
    )


def _pick(rng: np.random.Generator, table: tuple[tuple[tuple[int, int, int], float], ...]) -> RGB:
    weights = np.array([w for _, w in table])
    colour = table[int(rng.choice(len(table), p=weights / weights.sum()))][0]
    return np.array(colour, dtype=np.float32)


# --- shapes -----------------------------------------------------------------------------------------


def box(f: Frame, cu: float, cv: float, hu: float, hv: float, r: float = 0.0) -> Field:
    """Signed distance to a rounded axis-aligned box (negative inside)."""
    qu, qv = np.abs(f.u - cu) - (hu - r), np.abs(f.v - cv) - (hv - r)
    return np.hypot(np.maximum(qu, 0), np.maximum(qv, 0)) + np.minimum(np.maximum(qu, qv), 0) - r


def ellipse(f: Frame, cu: float, cv: float, ru: float, rv: float) -> Field:
    """Approximate signed distance to an ellipse (exact on the axes, good enough for coverage)."""
    return (np.hypot((f.u - cu) / ru, (f.v - cv) / rv) - 1) * min(ru, rv)


def cover(f: Frame, sdf: Field) -> Field:
    return np.clip(0.5 - sdf * f.px, 0.0, 1.0)


def paint(img: RGB, alpha: Field, colour: RGB | Field) -> None:
    img += alpha[..., None] * (colour - img)


def _shaded(lay: Layout, nu: Field, nv: Field, gloss: float) -> RGB:
    """Solder colour on a surface with unit normal (nu, nv, nz): Lambert plus a specular highlight."""
    nz = np.sqrt(np.clip(1 - nu * nu - nv * nv, 0, 1))
    lu, lv, lz = lay.light
    lambert = np.clip(nu * lu + nv * lv + nz * lz, 0, 1)
    hu, hv, hz = np.array([lu, lv, lz + 1]) / np.linalg.norm([lu, lv, lz + 1])
    spec = np.clip(nu * hu + nv * hv + nz * hz, 0, 1) ** 24
    return np.array(lay.solder, np.float32) * (0.3 + 0.7 * lambert)[..., None] + (gloss * 255 * spec)[..., None]


# --- scene ------------------------------------------------------------------------------------------


def _board(rng: np.random.Generator, f: Frame, lay: Layout) -> RGB:
    mask = _pick(rng, _BOARDS) * rng.uniform(0.8, 1.2) + rng.normal(0, 6, 3).astype(np.float32)
    wave = 1 + 0.04 * np.sin(2 * np.pi * (rng.uniform(1, 4) * f.u + rng.uniform(1, 4) * f.v + rng.uniform(0, 7)))
    img = np.broadcast_to(wave[..., None] * mask, (*f.u.shape, 3)).astype(np.float32)
    for side in (-1, 1):  # mask-covered traces leaving the pads read lighter than bare mask
        if rng.random() < 0.6:
            paint(img, cover(f, box(f, side * lay.pitch / 2, 0.5, rng.uniform(0.02, 0.035), 0.3)), mask * 1.35 + 12)
    if rng.random() < 0.35:
        _silkscreen(img, rng, f, lay)
    if rng.random() < 0.4:
        _via(img, rng, f, lay)
    pad = _pick(rng, _PAD_FINISHES) * rng.uniform(0.85, 1.1)
    hv, cv = (lay.pad_v1 - lay.pad_v0) / 2, (lay.pad_v1 + lay.pad_v0) / 2
    for side in (-1, 1):
        paint(img, cover(f, box(f, side * lay.pitch / 2, cv, lay.pad_hu, hv, 0.01)), pad)
    return img


def _silkscreen(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout) -> None:
    ink = np.array([228, 228, 218] if rng.random() < 0.8 else [225, 210, 110], np.float32)
    line_v = lay.pad_v1 + rng.uniform(0.07, 0.12)
    paint(img, cover(f, box(f, 0, line_v, 0.6, rng.uniform(0.008, 0.014))) * 0.9, ink)
    for _ in range(int(rng.integers(0, 3))):  # reference designators read as small hollow glyphs
        cu, cv = rng.uniform(-0.4, 0.4), line_v + rng.uniform(0.06, 0.12)
        paint(img, cover(f, np.abs(box(f, cu, cv, 0.022, 0.032)) - 0.007) * 0.9, ink)


def _via(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout) -> None:
    cu, cv = rng.uniform(-0.4, 0.4), rng.uniform(lay.pad_v1 + 0.08, 0.5)
    ring = np.array(lay.solder if rng.random() < 0.5 else (190, 120, 70), np.float32)
    paint(img, cover(f, ellipse(f, cu, cv, 0.035, 0.035)), ring)
    paint(img, cover(f, ellipse(f, cu, cv, 0.015, 0.015)), np.full(3, 18, np.float32))


def _joints(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout, label: str) -> None:
    kinds = {"good": ["good", "good"], "bridge": ["good", "good"]}.get(label)
    if kinds is None:  # a defective image has one or two defective joints, so the defect's side varies
        kinds = [label, label if rng.random() < 0.65 else "good"]
        rng.shuffle(kinds)
    for side, kind in zip((-1, 1), kinds, strict=True):
        if kind == "good":
            _fillet(img, rng, f, lay, side * lay.pitch / 2)
        elif kind == "insufficient":
            _starved(img, rng, f, lay, side * lay.pitch / 2)
    if label == "bridge":
        _bridge(img, rng, f, lay)
    for side in (-1, 1):
        _lead(img, f, lay, side * lay.pitch / 2)
    for side, kind in zip((-1, 1), kinds, strict=True):
        if kind == "excess":  # the blob engulfs the foot, so it goes on after the lead
            _blob(img, rng, f, lay, side * lay.pitch / 2)
    paint(img, cover(f, f.v - lay.body), np.full(3, rng.uniform(22, 45), np.float32))
    paint(img, cover(f, np.abs(f.v - lay.body + 0.012) - 0.006) * 0.5, np.full(3, 90, np.float32))


def _lead(img: RGB, f: Frame, lay: Layout, cu: float) -> None:
    hv, cv = (lay.toe - lay.body) / 2, (lay.toe + lay.body) / 2
    sdf = box(f, cu, cv, lay.lead_hu, hv, 0.005)
    paint(
        img, cover(f, np.abs(sdf) - 0.004) * 0.7, np.full(3, 30, np.float32)
    )  # the crease where solder meets the lead
    # The gull-wing knee slopes away from the lamp and reads darker than the flat foot.
    knee = np.clip((f.v - lay.body) / (lay.pad_v0 - lay.body), 0.45, 1.0)[..., None]
    paint(img, cover(f, sdf), np.array([170, 172, 176], np.float32) * knee)


def _fillet(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout, cu: float) -> None:
    margin, width = rng.uniform(0.0, 0.012), rng.uniform(0.03, 0.06)
    hv, cv = (lay.pad_v1 - lay.pad_v0) / 2, (lay.pad_v1 + lay.pad_v0) / 2
    alpha = cover(f, box(f, cu, cv, lay.pad_hu - margin, hv - margin, rng.uniform(0.01, 0.04)))
    # A concave fillet is steep against the lead and flattens towards the pad edge: steep faces send
    # the lamp's light away, so it is dark by the lead, bright at the rim, with a ring of glare between.
    d = np.clip(box(f, cu, (lay.toe + lay.pad_v0) / 2, lay.lead_hu, (lay.toe - lay.pad_v0) / 2) / width, 0, 1)
    glare = np.exp(-(((d - 0.55) / 0.2) ** 2)) * rng.uniform(0.1, 0.35)
    shade = np.array(lay.solder, np.float32) * (0.45 + 0.5 * d * (2 - d))[..., None] + (255 * glare)[..., None]
    paint(img, alpha, shade)


def _starved(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout, cu: float) -> None:
    if rng.random() < 0.5:  # a thin skin along part of the lead
        r, frac = rng.uniform(0.006, 0.02), rng.uniform(0.4, 0.9)
        v0 = lay.toe - frac * (lay.toe - lay.pad_v0)
        sdf = box(f, cu, (lay.toe + v0) / 2 + 0.01, lay.lead_hu + r, (lay.toe - v0) / 2 + r, r)
    else:  # solder wetted only the heel or only the toe end of the pad
        hv = (lay.pad_v1 - lay.pad_v0) * rng.uniform(0.15, 0.27)
        cv = lay.pad_v0 + hv if rng.random() < 0.5 else lay.pad_v1 - hv
        sdf = box(f, cu, cv, lay.pad_hu * rng.uniform(0.7, 0.95), hv, 0.02)
    for _ in range(int(rng.integers(0, 3))):  # dewetted beads
        r = rng.uniform(0.01, 0.02)
        bead = ellipse(f, cu + rng.uniform(-1, 1) * lay.pad_hu * 0.7, rng.uniform(lay.pad_v0, lay.pad_v1), r, r)
        sdf = np.minimum(sdf, bead)
    paint(img, cover(f, sdf), np.array(lay.solder, np.float32) * 0.85)


def _blob(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout, cu: float) -> None:
    # Wider than the pad on every side, but short of the neighbour: touching it would be a bridge.
    ru = min(lay.pad_hu * rng.uniform(1.3, 1.75), lay.pitch / 2 - 0.05)
    rv = (lay.pad_v1 - lay.pad_v0) / 2 * rng.uniform(0.95, 1.2)
    cu, cv = cu + rng.uniform(-0.015, 0.015), (lay.pad_v1 + lay.pad_v0) / 2 + rng.uniform(-0.02, 0.05)
    colour = _shaded(lay, (f.u - cu) / ru, (f.v - cv) / rv, rng.uniform(0.3, 0.8))
    paint(img, cover(f, ellipse(f, cu, cv, ru, rv)), colour)


def _bridge(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout) -> None:
    half_u = lay.pitch / 2
    cv, hb = rng.uniform(lay.pad_v0 + 0.05, lay.pad_v1 - 0.06), rng.uniform(0.03, 0.065)
    neck = rng.uniform(0.55, 0.9)  # surface tension pinches the bar between the pads
    t = np.clip(f.u / half_u, -1, 1)
    half = hb * (neck + (1 - neck) * t * t) + 0.004 * np.sin(f.u * rng.uniform(20, 40))
    sdf = np.maximum(np.abs(f.v - cv) - half, np.abs(f.u) - half_u)
    colour = _shaded(lay, np.zeros_like(f.u), np.clip((f.v - cv) / half, -1, 1), rng.uniform(0.3, 0.7))
    paint(img, cover(f, sdf), colour)


def _camera(img: RGB, rng: np.random.Generator, f: Frame) -> NDArray[np.uint8]:
    height, width = f.u.shape
    y, x = np.mgrid[0:height, 0:width].astype(np.float32) / max(height, width) - 0.5
    angle = rng.uniform(0, 2 * np.pi)
    ramp = 1 + rng.uniform(0, 0.5) * (x * np.cos(angle) + y * np.sin(angle))
    balance = np.clip(rng.normal(1, 0.06, 3), 0.85, 1.15).astype(np.float32)
    img *= (rng.uniform(0.75, 1.2) * ramp)[..., None] * balance
    blur = rng.uniform(0, 1)  # a slightly soft focus: blend with a separable [1, 2, 1] kernel
    soft = np.pad(img, ((1, 1), (1, 1), (0, 0)), mode="edge")
    soft = (soft[:-2] + 2 * soft[1:-1] + soft[2:]) / 4
    soft = (soft[:, :-2] + 2 * soft[:, 1:-1] + soft[:, 2:]) / 4
    img += blur * (soft - img)
    img += rng.standard_normal(img.shape, dtype=np.float32) * rng.uniform(1.5, 5)
    return np.clip(img + 0.5, 0, 255).astype(np.uint8)
