"""One synthetic top-down image of two SMD solder joints (numpy only; encoding is the caller's job).

The scene is drawn in canonical units, where the unrotated image spans [-0.5, 0.5]: an IC package
along the top edge, two of its gull-wing leads resting on copper pads either side of the centre, and
the solder on each pad, whose shape is the class. Shapes are signed distance fields turned into
anti-aliased coverage, so one image costs a few dozen array operations at the target size.

Every draw comes from the generator passed in, so an image depends only on (class, generator, size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

# float32 throughout (half the memory traffic of float64); typed loosely because numpy's stubs widen
# float32 arithmetic with Python floats to float64.
Field = NDArray[np.floating[Any]]
RGB = NDArray[np.floating[Any]]

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
    """Canonical coordinates of the pixel centres in ``window`` of the image, and the pixel mapping.

    ``px`` is pixels per canonical unit (for anti-aliasing); a pixel's column is
    ``origin[0] + axes[0] * u + axes[1] * v`` and its row ``origin[1] + axes[2] * u + axes[3] * v``.
    """

    u: Field
    v: Field
    px: float
    origin: tuple[float, float]
    axes: tuple[float, float, float, float]
    window: tuple[slice, slice] = (slice(None), slice(None))

    def crop(self, u0: float, v0: float, u1: float, v1: float) -> Frame:
        """The pixels that can see the canonical box [u0, u1] x [v0, v1] (call on the whole frame).

        Shapes are small, so drawing each one only in its window is most of the renderer's speed.
        """
        col_u, col_v, row_u, row_v = self.axes
        # Plain floats: numpy's per-call overhead would cost more than the four corners themselves.
        cols = [self.origin[0] + col_u * u + col_v * v for u in (u0, u1) for v in (v0, v1)]
        rows = [self.origin[1] + row_u * u + row_v * v for u in (u0, u1) for v in (v0, v1)]
        height, width = self.u.shape
        r0, r1 = max(int(min(rows)) - 1, 0), min(int(max(rows)) + 3, height)
        c0, c1 = max(int(min(cols)) - 1, 0), min(int(max(cols)) + 3, width)
        window = (slice(r0, max(r0, r1)), slice(c0, max(c0, c1)))
        return Frame(self.u[window], self.v[window], self.px, self.origin, self.axes, window)

    def around(self, cu: float, cv: float, hu: float, hv: float) -> Frame:
        return self.crop(cu - hu, cv - hv, cu + hu, cv + hv)


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
    zoom, scale = rng.uniform(0.92, 1.08), min(width, height)
    du, dv = rng.uniform(-0.035, 0.035), rng.uniform(-0.035, 0.035)
    x = ((np.arange(width, dtype=np.float32) + 0.5 - width / 2) / scale - du)[None, :]
    y = ((np.arange(height, dtype=np.float32) + 0.5 - height / 2) / scale - dv)[:, None]
    c, s = np.float32(np.cos(theta) / zoom), np.float32(np.sin(theta) / zoom)
    px = float(scale * zoom)
    origin = (scale * du + width / 2 - 0.5, scale * dv + height / 2 - 0.5)
    cos, sin = px * float(np.cos(theta)), px * float(np.sin(theta))
    axes = (cos, -sin, sin, cos)
    return Frame(u=c * x + s * y, v=c * y - s * x, px=px, origin=origin, axes=axes)


def _layout(rng: np.random.Generator) -> Layout:
    pad_hu = rng.uniform(0.075, 0.095)
    elevation, azimuth = rng.uniform(0.8, 1.3), rng.uniform(0, 2 * np.pi)
    solder = np.array([188, 190, 194]) * rng.uniform(0.8, 1.05) + rng.normal(0, 3, 3)
    return Layout(
        pitch=rng.uniform(0.43, 0.49),
        pad_hu=pad_hu,
        pad_v0=rng.uniform(-0.16, -0.10),
        pad_v1=rng.uniform(0.26, 0.32),
        lead_hu=pad_hu * rng.uniform(0.5, 0.62),
        toe=rng.uniform(0.08, 0.16),
        body=rng.uniform(-0.34, -0.27),
        light=(np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth), np.sin(elevation)),
        solder=(float(solder[0]), float(solder[1]), float(solder[2])),
    )


def _pick(rng: np.random.Generator, table: tuple[tuple[tuple[int, int, int], float], ...]) -> RGB:
    draw, total = rng.random(), 0.0
    for colour, weight in table:
        total += weight
        if draw < total:
            return _rgb(colour)
    return _rgb(table[-1][0])


def _rgb(colour: tuple[float, float, float] | NDArray[np.float64]) -> RGB:
    """A colour shaped (3, 1, 1), to broadcast over channel-first (3, height, width) images."""
    # Channel-first because numpy loops over the last axis: a last axis of 3 makes every blend slow.
    return np.asarray(colour, dtype=np.float32).reshape(3, 1, 1)


def _grey(level: float) -> RGB:
    return _rgb((level, level, level))


# --- shapes: signed distances (negative inside) on a frame, turned into coverage and blended --------


def box(f: Frame, cu: float, cv: float, hu: float, hv: float, r: float = 0.0) -> Field:
    """Signed distance to a rounded axis-aligned box."""
    qu, qv = np.abs(f.u - cu) - (hu - r), np.abs(f.v - cv) - (hv - r)
    ou, ov = np.maximum(qu, 0), np.maximum(qv, 0)
    sdf: Field = np.sqrt(ou * ou + ov * ov) + np.minimum(np.maximum(qu, qv), 0) - r
    return sdf


def ellipse(f: Frame, cu: float, cv: float, ru: float, rv: float) -> Field:
    """Approximate signed distance to an ellipse (exact on the axes, good enough for coverage)."""
    du, dv = (f.u - cu) / ru, (f.v - cv) / rv
    sdf: Field = (np.sqrt(du * du + dv * dv) - 1) * min(ru, rv)
    return sdf


def cover(f: Frame, sdf: Field) -> Field:
    """Anti-aliased coverage: 1 inside, 0 outside, a linear ramp one pixel wide across the edge."""
    alpha: Field = np.clip(0.5 - sdf * f.px, 0.0, 1.0)
    return alpha


def paint(img: RGB, f: Frame, alpha: Field, colour: RGB) -> None:
    """Blend ``colour`` (one RGB, or a field over ``f``) over the image where ``alpha`` covers it."""
    under = img[(slice(None), *f.window)]
    under += alpha * (colour - under)


def _shaded(f: Frame, lay: Layout, nu: Field, nv: Field, gloss: float) -> RGB:
    """Solder colour on a surface with unit normal (nu, nv, nz): Lambert plus a specular highlight."""
    nz = np.sqrt(np.clip(1 - nu * nu - nv * nv, 0, 1))
    lu, lv, lz = lay.light
    lambert = np.clip(nu * lu + nv * lv + nz * lz, 0, 1)
    hu, hv, hz = np.array([lu, lv, lz + 1]) / np.linalg.norm([lu, lv, lz + 1])
    spec = np.clip(nu * hu + nv * hv + nz * hz, 0, 1) ** 24
    colour: RGB = _rgb(lay.solder) * (0.3 + 0.7 * lambert) + gloss * 255 * spec
    return colour


# --- scene ------------------------------------------------------------------------------------------


def _board(rng: np.random.Generator, f: Frame, lay: Layout) -> RGB:
    mask = _pick(rng, _BOARDS) * rng.uniform(0.8, 1.2) + _rgb(rng.normal(0, 6, 3))
    wave = 1 + 0.04 * np.sin(2 * np.pi * (rng.uniform(1, 4) * f.u + rng.uniform(1, 4) * f.v + rng.uniform(0, 7)))
    img = wave * mask
    for side in (-1, 1):  # mask-covered traces leaving the pads read lighter than bare mask
        if rng.random() < 0.6:
            cu, hu = side * lay.pitch / 2, rng.uniform(0.02, 0.035)
            g = f.crop(cu - hu, lay.pad_v1 - 0.01, cu + hu, 0.8)
            paint(img, g, cover(g, box(g, cu, 0.5, hu, 0.3)), mask * 1.35 + 12)
    if rng.random() < 0.35:
        _silkscreen(img, rng, f, lay)
    if rng.random() < 0.4:
        _via(img, rng, f, lay)
    pad = _pick(rng, _PAD_FINISHES) * rng.uniform(0.85, 1.1)
    hv, cv = (lay.pad_v1 - lay.pad_v0) / 2, (lay.pad_v1 + lay.pad_v0) / 2
    for side in (-1, 1):
        g = f.around(side * lay.pitch / 2, cv, lay.pad_hu, hv)
        paint(img, g, cover(g, box(g, side * lay.pitch / 2, cv, lay.pad_hu, hv, 0.01)), pad)
    return img


def _silkscreen(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout) -> None:
    ink = _rgb((228, 228, 218) if rng.random() < 0.8 else (225, 210, 110))
    line_v, half = lay.pad_v1 + rng.uniform(0.07, 0.12), rng.uniform(0.008, 0.014)
    g = f.around(0, line_v, 0.8, half)
    paint(img, g, cover(g, box(g, 0, line_v, 0.8, half)) * 0.9, ink)
    for _ in range(int(rng.integers(0, 3))):  # reference designators read as small hollow glyphs
        cu, cv = rng.uniform(-0.4, 0.4), line_v + rng.uniform(0.06, 0.12)
        g = f.around(cu, cv, 0.03, 0.04)
        paint(img, g, cover(g, np.abs(box(g, cu, cv, 0.022, 0.032)) - 0.007) * 0.9, ink)


def _via(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout) -> None:
    cu, cv = rng.uniform(-0.4, 0.4), rng.uniform(lay.pad_v1 + 0.08, 0.5)
    ring = _rgb(lay.solder if rng.random() < 0.5 else (190, 120, 70))
    g = f.around(cu, cv, 0.04, 0.04)
    paint(img, g, cover(g, ellipse(g, cu, cv, 0.035, 0.035)), ring)
    paint(img, g, cover(g, ellipse(g, cu, cv, 0.015, 0.015)), _grey(18))


def _joints(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout, label: str) -> None:
    kinds = {"good": ["good", "good"], "bridge": ["good", "good"]}.get(label)
    if kinds is None:  # a defective image has one or two defective joints, so the defect's side varies
        kinds = [label, label if rng.random() < 0.8 else "good"]
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
    g = f.crop(-0.8, -0.8, 0.8, lay.body + 0.01)
    paint(img, g, cover(g, g.v - lay.body), _grey(rng.uniform(22, 45)))
    paint(img, g, cover(g, np.abs(g.v - lay.body + 0.012) - 0.006) * 0.5, _grey(90))


def _lead(img: RGB, f: Frame, lay: Layout, cu: float) -> None:
    hv, cv = (lay.toe - lay.body) / 2, (lay.toe + lay.body) / 2
    g = f.around(cu, cv, lay.lead_hu + 0.01, hv + 0.01)
    sdf = box(g, cu, cv, lay.lead_hu, hv, 0.005)
    paint(img, g, cover(g, np.abs(sdf) - 0.004) * 0.7, _grey(30))  # the crease where solder meets the lead
    # The gull-wing knee slopes away from the lamp and reads darker than the flat foot.
    knee = np.clip((g.v - lay.body) / (lay.pad_v0 - lay.body), 0.45, 1.0)
    paint(img, g, cover(g, sdf), _rgb((170, 172, 176)) * knee)


def _fillet(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout, cu: float) -> None:
    margin, width = rng.uniform(0.0, 0.008), rng.uniform(0.04, 0.08)
    hv, cv = (lay.pad_v1 - lay.pad_v0) / 2, (lay.pad_v1 + lay.pad_v0) / 2
    g = f.around(cu, cv, lay.pad_hu, hv)
    alpha = cover(g, box(g, cu, cv, lay.pad_hu - margin, hv - margin, rng.uniform(0.01, 0.04)))
    # A concave fillet is steep against the lead and flattens towards the pad edge: steep faces send
    # the lamp's light away, so it is dark by the lead, bright at the rim, with a ring of glare between.
    d = np.clip(box(g, cu, (lay.toe + lay.pad_v0) / 2, lay.lead_hu, (lay.toe - lay.pad_v0) / 2) / width, 0, 1)
    glare = np.exp(-(((d - 0.55) / 0.2) ** 2)) * rng.uniform(0.1, 0.35)
    shade = _rgb(lay.solder) * (0.35 + 0.65 * d * (2 - d)) + 255 * glare
    paint(img, g, alpha, shade)


def _starved(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout, cu: float) -> None:
    hv, cv = (lay.pad_v1 - lay.pad_v0) / 2, (lay.pad_v1 + lay.pad_v0) / 2
    g = f.around(cu, cv, lay.pad_hu + 0.02, hv + 0.02)
    if rng.random() < 0.5:  # a thin skin along part of the lead
        r, frac = rng.uniform(0.006, 0.02), rng.uniform(0.4, 0.9)
        v0 = lay.toe - frac * (lay.toe - lay.pad_v0)
        sdf = box(g, cu, (lay.toe + v0) / 2 + 0.01, lay.lead_hu + r, (lay.toe - v0) / 2 + r, r)
    else:  # solder wetted only the heel or only the toe end of the pad
        part = 2 * hv * rng.uniform(0.15, 0.27)
        at = lay.pad_v0 + part if rng.random() < 0.5 else lay.pad_v1 - part
        sdf = box(g, cu, at, lay.pad_hu * rng.uniform(0.7, 0.95), part, 0.02)
    for _ in range(int(rng.integers(0, 3))):  # dewetted beads
        r = rng.uniform(0.01, 0.02)
        bead = ellipse(g, cu + rng.uniform(-1, 1) * lay.pad_hu * 0.7, rng.uniform(lay.pad_v0, lay.pad_v1), r, r)
        sdf = np.minimum(sdf, bead)
    paint(img, g, cover(g, sdf), _rgb(lay.solder) * 0.85)


def _blob(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout, cu: float) -> None:
    # Wider than the pad on every side, but short of the neighbour: touching it would be a bridge.
    ru = min(lay.pad_hu * rng.uniform(1.3, 1.75), lay.pitch / 2 - 0.05)
    rv = (lay.pad_v1 - lay.pad_v0) / 2 * rng.uniform(0.95, 1.2)
    cu, cv = cu + rng.uniform(-0.015, 0.015), (lay.pad_v1 + lay.pad_v0) / 2 + rng.uniform(-0.02, 0.05)
    g = f.around(cu, cv, ru, rv)
    colour = _shaded(g, lay, (g.u - cu) / ru, (g.v - cv) / rv, rng.uniform(0.3, 0.8))
    paint(img, g, cover(g, ellipse(g, cu, cv, ru, rv)), colour)


def _bridge(img: RGB, rng: np.random.Generator, f: Frame, lay: Layout) -> None:
    half_u = lay.pitch / 2
    cv, hb = rng.uniform(lay.pad_v0 + 0.08, lay.pad_v1 - 0.1), rng.uniform(0.04, 0.075)
    neck = rng.uniform(0.55, 0.9)  # surface tension pinches the bar between the pads
    g = f.around(0, cv, half_u, hb + 0.01)
    t = np.clip(g.u / half_u, -1, 1)
    half = hb * (neck + (1 - neck) * t * t) + 0.004 * np.sin(g.u * rng.uniform(20, 40))
    sdf = np.maximum(np.abs(g.v - cv) - half, np.abs(g.u) - half_u)
    colour = _shaded(g, lay, np.zeros_like(g.u), np.clip((g.v - cv) / half, -1, 1), rng.uniform(0.3, 0.7))
    paint(img, g, cover(g, sdf), colour)


def _camera(img: RGB, rng: np.random.Generator, f: Frame) -> NDArray[np.uint8]:
    height, width = f.u.shape
    angle, ramp = rng.uniform(0, 2 * np.pi), rng.uniform(0, 0.5) / max(height, width)
    x = (np.arange(width, dtype=np.float32) - width / 2) * np.float32(ramp * np.cos(angle))
    y = (np.arange(height, dtype=np.float32) - height / 2) * np.float32(ramp * np.sin(angle))
    balance = np.clip(rng.normal(1, 0.04, 3), 0.9, 1.1) * rng.uniform(0.75, 1.2)
    img *= (1 + x[None, :] + y[:, None]) * _rgb(balance)
    # A slightly soft focus: blend towards a separable [1, 2, 1] blur (the outermost pixels stay sharp).
    blur = np.float32(rng.uniform(0, 1) / 16)
    soft = img.copy()
    soft[:, 1:-1] = 2 * img[:, 1:-1] + img[:, :-2] + img[:, 2:]
    inner = img[:, 1:-1, 1:-1]
    inner += blur * (2 * soft[:, 1:-1, 1:-1] + soft[:, 1:-1, :-2] + soft[:, 1:-1, 2:] - 16 * inner)
    # Sensor noise: the sum of two uniform bytes is near enough Gaussian, and far cheaper to draw.
    noise = np.frombuffer(rng.bytes(2 * img.size), np.uint8).reshape(2, *img.shape)
    img += (noise[0] + noise[1].astype(np.float32) - 255) * np.float32(rng.uniform(1.5, 5) / 104)
    return np.ascontiguousarray(np.clip(img + 0.5, 0, 255).astype(np.uint8).transpose(1, 2, 0))
