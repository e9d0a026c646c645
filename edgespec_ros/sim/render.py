"""Rendering: the Go2's first-person camera (numpy ray casting) and a top-down map.

The camera casts one ray per pixel against the room (floor, four walls, ceiling) and against
each object's 3-D primitives (oriented boxes, vertical cone frustums, spheres), keeping the
nearest hit per pixel (a z-buffer), so perspective and occlusion are exact. It is
deterministic: the same scenario and pose give the same array. Pixel columns left of centre
look to the robot's left (positive, CCW bearings).

Only numpy is needed for the camera; the top-down map uses Pillow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np

from .scenario import (COLOR_RGB, FOOTPRINT_RADIUS_M, OBJECT_HEIGHT_M, ROBOT_RADIUS_M, Pose,
                       Scenario, SceneObject)

WALL_HEIGHT_M = 2.5
_EPS = 1e-6


@dataclass(frozen=True)
class CameraConfig:
    """A pinhole camera on the robot: image size, horizontal FOV, mounting height and pitch.

    Defaults match the tiny VLMs (112 x 112) and a Go2-like front camera (90 degrees wide,
    0.3 m above the floor, level).
    """

    width: int = 112
    height: int = 112
    hfov_deg: float = 90.0
    mount_height_m: float = 0.3
    pitch_deg: float = 0.0

    def __post_init__(self):
        for name in ("width", "height"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 8:
                raise ValueError(f"CameraConfig.{name}: expected a whole number of pixels >= 8, got {value!r}")
        if not 10.0 <= self.hfov_deg <= 170.0:
            raise ValueError(f"CameraConfig.hfov_deg: {self.hfov_deg} is outside [10, 170] degrees")
        if not 0.05 <= self.mount_height_m < WALL_HEIGHT_M:
            raise ValueError(f"CameraConfig.mount_height_m: {self.mount_height_m} must be in "
                             f"[0.05, {WALL_HEIGHT_M}) m")
        if not -60.0 <= self.pitch_deg <= 60.0:
            raise ValueError(f"CameraConfig.pitch_deg: {self.pitch_deg} is outside [-60, 60] degrees")

    @property
    def focal_px(self) -> float:
        """Focal length in pixels (square pixels)."""
        return (self.width / 2.0) / math.tan(math.radians(self.hfov_deg) / 2.0)

    @property
    def half_hfov_rad(self) -> float:
        """Half the horizontal field of view, in radians."""
        return math.radians(self.hfov_deg) / 2.0



DEFAULT_CAMERA = CameraConfig()


@dataclass(frozen=True)
class CameraView:
    """One rendered frame: ``rgb`` (H, W, 3) uint8; ``object_index`` (H, W) int16, the index into
    ``scenario.objects`` seen at each pixel or -1 for the room; ``depth`` (H, W) float32, the
    distance along the optical axis in metres."""

    rgb: np.ndarray
    object_index: np.ndarray
    depth: np.ndarray

    def pixel_counts(self, n_objects: int) -> np.ndarray:
        """How many pixels show each of the ``n_objects`` scenario objects."""
        visible = self.object_index[self.object_index >= 0]
        return np.bincount(visible, minlength=n_objects)[:n_objects]


# --------------------------------------------------------------------------------------------
# Object models: primitives in the object's frame (x forward, y left, z up; origin on the floor
# at the object's centre). Each primitive is (kind, params, shade): shade scales the colour so
# parts read as parts (chair legs darker, bottle cap darker).

@dataclass(frozen=True)
class _Box:
    center: tuple[float, float, float]
    half: tuple[float, float, float]
    shade: float = 1.0


@dataclass(frozen=True)
class _Frustum:
    """Vertical truncated cone around the object's z axis through (cx, cy): radius r0 at z0, r1 at z1."""
    cx: float
    cy: float
    z0: float
    z1: float
    r0: float
    r1: float
    shade: float = 1.0


@dataclass(frozen=True)
class _Sphere:
    center: tuple[float, float, float]
    radius: float
    shade: float = 1.0


def _chair() -> tuple:
    legs = tuple(_Box((sx * 0.2, sy * 0.2, 0.21), (0.02, 0.02, 0.21), 0.7)
                 for sx in (-1, 1) for sy in (-1, 1))
    seat = _Box((0.0, 0.0, 0.445), (0.23, 0.23, 0.025))
    back = _Box((-0.205, 0.0, 0.68), (0.025, 0.23, 0.21), 0.9)  # the back is behind the seat (-x)
    return (seat, back) + legs


OBJECT_MODELS: dict[str, tuple] = {
    "chair": _chair(),
    "bottle": (
        _Frustum(0.0, 0.0, 0.0, 0.20, 0.04, 0.04),
        _Frustum(0.0, 0.0, 0.20, 0.245, 0.04, 0.017),
        _Frustum(0.0, 0.0, 0.245, 0.29, 0.017, 0.017),
        _Frustum(0.0, 0.0, 0.29, 0.31, 0.02, 0.02, 0.6),
    ),
    "box": (_Box((0.0, 0.0, 0.2), (0.2, 0.2, 0.2)),),
    "ball": (_Sphere((0.0, 0.0, 0.15), 0.15),),
    "cone": (
        _Box((0.0, 0.0, 0.015), (0.16, 0.16, 0.015), 0.8),
        _Frustum(0.0, 0.0, 0.03, 0.42, 0.12, 0.012),
    ),
}

_FLOOR_RGB = (np.array([150, 114, 78], np.float32), np.array([132, 98, 66], np.float32))
_CEILING_RGB = np.array([168, 162, 152], np.float32)
# One tint per wall (x=0, x=W, y=0, y=D) so the robot can tell walls apart.
_WALL_RGB = np.array([[210, 190, 150], [168, 188, 150], [214, 172, 158], [204, 178, 116]], np.float32)
_BASEBOARD_RGB = np.array([96, 78, 62], np.float32)
_LIGHT = np.array([-0.35, 0.45, 1.0]) / np.linalg.norm([-0.35, 0.45, 1.0])


@lru_cache(maxsize=16)
def _camera_rays(camera: CameraConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-pixel ray directions in the robot frame (forward, left, up), unnormalised so that the
    component along the optical axis is 1 (ray parameter t = depth along the optical axis)."""
    f = camera.focal_px
    cols = (np.arange(camera.width) + 0.5 - camera.width / 2.0) / f
    rows = (camera.height / 2.0 - (np.arange(camera.height) + 0.5)) / f
    right, up = np.meshgrid(cols, rows)
    forward = np.ones_like(right)
    left = -right
    pitch = math.radians(camera.pitch_deg)
    c, s = math.cos(pitch), math.sin(pitch)
    fwd_p, up_p = c * forward - s * up, s * forward + c * up
    for a in (fwd_p, left, up_p):
        a.setflags(write=False)
    return fwd_p, left, up_p


def render_camera(scenario: Scenario, pose: Pose, camera: CameraConfig = DEFAULT_CAMERA) -> np.ndarray:
    """The camera image (H, W, 3) uint8 seen from ``pose``; deterministic in (scenario, pose, camera)."""
    return render_view(scenario, pose, camera).rgb


def render_view(scenario: Scenario, pose: Pose, camera: CameraConfig = DEFAULT_CAMERA) -> CameraView:
    """Render the camera image plus the per-pixel object index and depth seen from ``pose``."""
    fwd, left, up = _camera_rays(camera)
    cy, sy = math.cos(pose.yaw_rad), math.sin(pose.yaw_rad)
    dx = cy * fwd - sy * left
    dy = sy * fwd + cy * left
    dz = up
    ox, oy, oz = pose.x, pose.y, camera.mount_height_m
    room = scenario.room

    # The room is a box around the camera: each ray leaves it through the nearest face.
    with np.errstate(divide="ignore", invalid="ignore"):
        t_x = np.where(dx > 0, (room.width_m - ox) / dx, np.where(dx < 0, -ox / dx, np.inf))
        t_y = np.where(dy > 0, (room.depth_m - oy) / dy, np.where(dy < 0, -oy / dy, np.inf))
        t_z = np.where(dz > 0, (WALL_HEIGHT_M - oz) / dz, np.where(dz < 0, -oz / dz, np.inf))
    depth = np.minimum(np.minimum(t_x, t_y), t_z)
    rgb = _shade_room(room, ox, oy, oz, dx, dy, dz, depth, t_x, t_y, t_z)

    index = np.full(depth.shape, -1, np.int16)
    for obj_i, obj in enumerate(scenario.objects):
        window = _screen_window(obj, pose, camera)
        if window is None:
            continue
        rs, cs = window
        _cast_object(obj, obj_i, ox, oy, oz, dx[rs, cs], dy[rs, cs], dz[rs, cs],
                     depth[rs, cs], index[rs, cs], rgb[rs, cs])
    return CameraView(np.clip(rgb, 0, 255).astype(np.uint8), index, depth.astype(np.float32))


def _shade_room(room, ox, oy, oz, dx, dy, dz, depth, t_x, t_y, t_z) -> np.ndarray:
    hx, hy, hz = ox + depth * dx, oy + depth * dy, oz + depth * dz
    rgb = np.empty(depth.shape + (3,), np.float32)
    floor = (t_z <= depth) & (dz < 0)
    ceiling = (t_z <= depth) & (dz > 0)
    wall_x = (t_x <= depth) & ~floor & ~ceiling
    wall_y = ~floor & ~ceiling & ~wall_x
    checker = ((np.floor(hx / 0.5) + np.floor(hy / 0.5)) % 2).astype(bool)
    rgb[floor] = np.where(checker[floor, None], _FLOOR_RGB[0], _FLOOR_RGB[1])
    rgb[ceiling] = _CEILING_RGB
    wall_id = np.where(wall_x, np.where(dx > 0, 1, 0), np.where(dy > 0, 3, 2))
    walls = wall_x | wall_y
    rgb[walls] = _WALL_RGB[wall_id[walls]]
    rgb[walls & (hz < 0.1)] = _BASEBOARD_RGB
    # Darken with distance so depth reads even in a flat-coloured room.
    distance = depth * np.sqrt(dx * dx + dy * dy + dz * dz)
    rgb *= (0.62 + 0.38 * np.exp(-distance / 5.0))[..., None]
    return rgb


def _screen_window(obj: SceneObject, pose: Pose, camera: CameraConfig):
    """Rows/cols slices bounding the object's projection, or None when it is wholly behind."""
    r = FOOTPRINT_RADIUS_M[obj.type]
    h = OBJECT_HEIGHT_M[obj.type]
    corners_x = obj.x + np.array([-r, r, -r, r, -r, r, -r, r]) - pose.x
    corners_y = obj.y + np.array([-r, -r, r, r, -r, -r, r, r]) - pose.y
    corners_z = np.array([0, 0, 0, 0, h, h, h, h], float) - camera.mount_height_m
    c, s = math.cos(pose.yaw_rad), math.sin(pose.yaw_rad)
    fwd = c * corners_x + s * corners_y
    left = -s * corners_x + c * corners_y
    pitch = math.radians(camera.pitch_deg)
    depth = math.cos(pitch) * fwd + math.sin(pitch) * corners_z
    up = -math.sin(pitch) * fwd + math.cos(pitch) * corners_z
    if np.all(depth <= 0.01):
        return None
    if np.any(depth <= 0.01):
        return slice(None), slice(None)
    f = camera.focal_px
    cols = camera.width / 2.0 - f * left / depth
    rows = camera.height / 2.0 - f * up / depth
    c0, c1 = int(math.floor(cols.min())) - 1, int(math.ceil(cols.max())) + 1
    r0, r1 = int(math.floor(rows.min())) - 1, int(math.ceil(rows.max())) + 1
    c0, r0 = max(c0, 0), max(r0, 0)
    c1, r1 = min(c1, camera.width), min(r1, camera.height)
    if c0 >= c1 or r0 >= r1:
        return None
    return slice(r0, r1), slice(c0, c1)


def _cast_object(obj: SceneObject, obj_i: int, ox: float, oy: float, oz: float,
                 dx: np.ndarray, dy: np.ndarray, dz: np.ndarray,
                 depth: np.ndarray, index: np.ndarray, rgb: np.ndarray) -> None:
    """Intersect the rays of one screen window with the object; update the window's z-buffer,
    object index and colour in place where the object is nearer."""
    # Work in the object's frame: translate to its centre and rotate by -yaw.
    yaw = math.radians(obj.yaw_deg)
    c, s = math.cos(yaw), math.sin(yaw)
    px, py = ox - obj.x, oy - obj.y
    lox, loy = c * px + s * py, -s * px + c * py
    ldx, ldy = c * dx + s * dy, -s * dx + c * dy
    for prim in OBJECT_MODELS[obj.type]:
        if isinstance(prim, _Box):
            t, normal = _hit_box(prim, lox, loy, oz, ldx, ldy, dz)
        elif isinstance(prim, _Frustum):
            t, normal = _hit_frustum(prim, lox, loy, oz, ldx, ldy, dz)
        else:
            t, normal = _hit_sphere(prim, lox, loy, oz, ldx, ldy, dz)
        nearer = t < depth
        if not nearer.any():
            continue
        nx, ny, nz = normal(nearer, t)
        # Back to the room frame for lighting.
        wnx, wny = c * nx - s * ny, s * nx + c * ny
        depth[nearer] = t[nearer]
        index[nearer] = obj_i
        view = np.stack([dx[nearer], dy[nearer], dz[nearer]], axis=-1)
        view /= np.linalg.norm(view, axis=-1, keepdims=True)
        rgb[nearer] = _shade_object(obj.color, prim.shade, np.stack([wnx, wny, nz], axis=-1), view)


def _shade_object(color: str, part_shade: float, normal: np.ndarray, view: np.ndarray) -> np.ndarray:
    """Colour of object pixels: matte Lambert + headlight for paints, a reflective metal for silver."""
    n_dot_l = np.clip(normal @ _LIGHT, 0.0, 1.0)
    n_dot_v = np.clip(-(normal * view).sum(-1), 0.0, 1.0)
    reflected = view - 2.0 * (view * normal).sum(-1, keepdims=True) * normal
    highlight = np.clip(reflected @ _LIGHT, 0.0, 1.0) ** 24
    base = np.array(COLOR_RGB[color], np.float32)
    if color == "silver":
        # Chrome: mirror the bright ceiling above the horizon and the brown floor below it.
        sky = np.clip(0.5 + 2.5 * reflected[:, 2:3], 0.0, 1.0)
        floor_tint = np.array([78, 72, 70], np.float32)
        sky_tint = np.array([222, 230, 246], np.float32)
        metal = floor_tint + sky * (sky_tint - floor_tint)
        rgb = (0.7 * metal + 0.3 * base * (0.55 + 0.45 * n_dot_v[:, None])) * part_shade
        return rgb + 255.0 * 0.9 * highlight[:, None]
    shade = 0.42 + 0.28 * n_dot_l + 0.3 * n_dot_v
    rgb = base * (shade * part_shade)[:, None]
    return rgb + 255.0 * 0.18 * highlight[:, None]


def _hit_box(box: _Box, ox, oy, oz, dx, dy, dz):
    """Ray/axis-aligned box (slab method) in the object frame."""
    origin = (ox - box.center[0], oy - box.center[1], oz - box.center[2])
    t_near = np.full(dx.shape, -np.inf)
    t_far = np.full(dx.shape, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        for o, d, h in zip(origin, (dx, dy, dz), box.half):
            t1 = (-h - o) / d
            t2 = (h - o) / d
            t_near = np.maximum(t_near, np.minimum(t1, t2))
            t_far = np.minimum(t_far, np.maximum(t1, t2))
    t = np.where((t_near <= t_far) & (t_near > _EPS), t_near, np.inf)

    def normal(mask, t_all):
        tm = t_all[mask]
        local = [o + tm * d[mask] for o, d in zip(origin, (dx, dy, dz))]
        ratios = np.stack([np.abs(p) / h for p, h in zip(local, box.half)], axis=-1)
        axis = ratios.argmax(axis=-1)
        return [np.where(axis == k, np.sign(local[k]), 0.0) for k in range(3)]

    return t, normal


def _hit_frustum(fr: _Frustum, ox, oy, oz, dx, dy, dz):
    """Ray/vertical cone frustum (side + top cap; bottom cap when seen from below)."""
    k = (fr.r1 - fr.r0) / (fr.z1 - fr.z0)
    px, py = ox - fr.cx, oy - fr.cy
    q0 = fr.r0 + k * (oz - fr.z0)
    a = dx * dx + dy * dy - (k * dz) ** 2
    b = 2.0 * (px * dx + py * dy - q0 * k * dz)
    cc = px * px + py * py - q0 * q0
    disc = b * b - 4.0 * a * cc
    t = np.full(dx.shape, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        root = np.sqrt(np.maximum(disc, 0.0))
        for sign in (-1.0, 1.0):
            tr = (-b + sign * root) / (2.0 * a)
            z = oz + tr * dz
            ok = (disc >= 0) & (tr > _EPS) & (z >= fr.z0) & (z <= fr.z1) & (q0 + k * dz * tr >= 0)
            t = np.where(ok & (tr < t), tr, t)
        caps = []
        if fr.r1 > 0 and oz > fr.z1:
            caps.append((fr.z1, fr.r1))
        if fr.r0 > 0 and oz < fr.z0:
            caps.append((fr.z0, fr.r0))
        for zc, rc in caps:
            tc = (zc - oz) / dz
            hx, hy = px + tc * dx, py + tc * dy
            ok = (tc > _EPS) & (hx * hx + hy * hy <= rc * rc)
            t = np.where(ok & (tc < t), tc, t)

    def normal(mask, t_all):
        tm = t_all[mask]
        hx, hy, hz = px + tm * dx[mask], py + tm * dy[mask], oz + tm * dz[mask]
        rho = np.maximum(np.hypot(hx, hy), 1e-9)
        nx, ny, nz = hx / rho, hy / rho, np.full_like(hx, -k)
        norm = np.sqrt(nx * nx + ny * ny + nz * nz)
        nx, ny, nz = nx / norm, ny / norm, nz / norm
        top = np.abs(hz - fr.z1) < 1e-7
        bottom = np.abs(hz - fr.z0) < 1e-7
        radius_here = fr.r0 + k * (hz - fr.z0)
        on_cap = (top | bottom) & (rho < radius_here - 1e-7)
        nx = np.where(on_cap, 0.0, nx)
        ny = np.where(on_cap, 0.0, ny)
        nz = np.where(on_cap, np.where(top, 1.0, -1.0), nz)
        return nx, ny, nz

    return t, normal


def _hit_sphere(sp: _Sphere, ox, oy, oz, dx, dy, dz):
    """Ray/sphere."""
    px, py, pz = ox - sp.center[0], oy - sp.center[1], oz - sp.center[2]
    a = dx * dx + dy * dy + dz * dz
    b = px * dx + py * dy + pz * dz
    cc = px * px + py * py + pz * pz - sp.radius ** 2
    disc = b * b - a * cc
    with np.errstate(invalid="ignore"):
        t0 = (-b - np.sqrt(disc)) / a
    t = np.where((disc >= 0) & (t0 > _EPS), t0, np.inf)

    def normal(mask, t_all):
        tm = t_all[mask]
        return [(p + tm * d[mask]) / sp.radius for p, d in ((px, dx), (py, dy), (pz, dz))]

    return t, normal


# --------------------------------------------------------------------------------------------
# Top-down map

def render_topdown(scenario: Scenario, pose: Pose | None = None,
                   trajectory: Sequence[Pose] | None = None, size_px: int = 480,
                   camera: CameraConfig | None = DEFAULT_CAMERA, labels: bool = True) -> np.ndarray:
    """A top-down map (size_px x size_px x 3 uint8): room, dead zones (hatched: no link there),
    objects (colour + shape hint + id), the goal radius, the trajectory polyline and the robot at ``pose`` (default: its start) with
    its camera's field of view. +x points right and +y up."""
    from PIL import Image, ImageDraw

    if size_px < 64:
        raise ValueError(f"render_topdown: size_px must be >= 64, got {size_px}")
    pose = scenario.robot if pose is None else pose
    ss = 2  # draw at twice the size, then downsample: cheap antialiasing
    canvas = size_px * ss
    margin = 0.06 * canvas
    room = scenario.room
    scale = (canvas - 2 * margin) / max(room.width_m, room.depth_m)
    x_off = margin + (canvas - 2 * margin - room.width_m * scale) / 2
    y_off = margin + (canvas - 2 * margin - room.depth_m * scale) / 2

    def px(x: float, y: float) -> tuple[float, float]:
        return x_off + x * scale, canvas - (y_off + y * scale)

    img = Image.new("RGB", (canvas, canvas), (60, 60, 64))
    draw = ImageDraw.Draw(img)
    draw.rectangle([px(0, room.depth_m), px(room.width_m, 0)], fill=(150, 114, 78),
                   outline=(206, 188, 156), width=3 * ss)
    for gx in range(1, int(math.ceil(room.width_m))):
        draw.line([px(gx, 0), px(gx, room.depth_m)], fill=(138, 104, 70), width=ss)
    for gy in range(1, int(math.ceil(room.depth_m))):
        draw.line([px(0, gy), px(room.width_m, gy)], fill=(138, 104, 70), width=ss)

    for zone in scenario.dead_zones:  # where the link drops (hatched grey: no verifier there)
        zx, zy = px(zone.x, zone.y)
        zr = zone.radius_m * scale
        draw.ellipse([zx - zr, zy - zr, zx + zr, zy + zr], fill=(112, 104, 100), outline=(200, 60, 60), width=2 * ss)
        for k in range(-3, 4):  # diagonal hatching, each line a chord of the circle
            d = k * zr / 4
            half = math.sqrt(zr * zr - d * d) / math.sqrt(2)
            cx, cy = zx + d / math.sqrt(2), zy + d / math.sqrt(2)
            draw.line([(cx - half, cy + half), (cx + half, cy - half)], fill=(200, 60, 60), width=ss)

    goal = scenario.goal_object
    gx, gy = px(goal.x, goal.y)
    rad = scenario.goal.radius_m * scale
    draw.ellipse([gx - rad, gy - rad, gx + rad, gy + rad], outline=(120, 255, 120), width=2 * ss)

    if camera is not None:
        reach = 1.5
        a0, a1 = pose.yaw_rad + camera.half_hfov_rad, pose.yaw_rad - camera.half_hfov_rad
        draw.polygon([px(pose.x, pose.y),
                      px(pose.x + reach * math.cos(a0), pose.y + reach * math.sin(a0)),
                      px(pose.x + reach * math.cos(a1), pose.y + reach * math.sin(a1))],
                     outline=(255, 255, 160))

    for obj in scenario.objects:
        _draw_object_marker(draw, obj, px, scale, ss, labels)

    if trajectory:
        points = [px(p.x, p.y) for p in trajectory]
        if len(points) > 1:
            draw.line(points, fill=(255, 80, 200), width=2 * ss, joint="curve")
        for point in points:
            draw.ellipse([point[0] - 2 * ss, point[1] - 2 * ss, point[0] + 2 * ss, point[1] + 2 * ss],
                         fill=(255, 80, 200))

    rx, ry = px(pose.x, pose.y)
    rr = ROBOT_RADIUS_M * scale
    draw.ellipse([rx - rr, ry - rr, rx + rr, ry + rr], fill=(40, 40, 40), outline=(255, 255, 255), width=ss)
    tip = px(pose.x + 0.45 * math.cos(pose.yaw_rad), pose.y + 0.45 * math.sin(pose.yaw_rad))
    draw.line([(rx, ry), tip], fill=(255, 255, 255), width=3 * ss)
    return np.asarray(img.resize((size_px, size_px), Image.LANCZOS), dtype=np.uint8).copy()


def _draw_object_marker(draw, obj: SceneObject, px, scale: float, ss: int, labels: bool) -> None:
    cx, cy = px(obj.x, obj.y)
    r = max(FOOTPRINT_RADIUS_M[obj.type] * scale, 4 * ss)
    fill = COLOR_RGB[obj.color]
    outline = (0, 0, 0) if obj.color != "black" else (255, 255, 255)
    if obj.type in ("box", "chair"):
        half = r / math.sqrt(2.0)
        yaw = math.radians(obj.yaw_deg)
        corners = []
        for sx, sy in ((1, 1), (-1, 1), (-1, -1), (1, -1)):
            lx, ly = sx * half, sy * half
            corners.append((cx + lx * math.cos(yaw) - ly * math.sin(yaw),
                            cy - (lx * math.sin(yaw) + ly * math.cos(yaw))))
        draw.polygon(corners, fill=fill, outline=outline, width=ss)
        if obj.type == "chair":  # the back, on the chair's -x side
            draw.line([corners[1], corners[2]], fill=outline, width=3 * ss)
    elif obj.type == "cone":
        draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)],
                     fill=fill, outline=outline, width=ss)
    elif obj.type == "bottle":
        draw.rounded_rectangle([cx - r * 0.6, cy - r * 1.6, cx + r * 0.6, cy + r * 1.2],
                               radius=r * 0.5, fill=fill, outline=outline, width=ss)
    else:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=outline, width=ss)
    if labels:
        draw.text((cx + r + 2 * ss, cy - r - 2 * ss), obj.id, fill=(255, 255, 255),
                  font_size=11 * ss)


def compose_side_by_side(images: Iterable[np.ndarray], height: int = 480, gap: int = 8) -> np.ndarray:
    """Scale each RGB image (nearest neighbour) to ``height`` rows and lay them out left to right."""
    from PIL import Image

    scaled = []
    for image in images:
        h, w = image.shape[:2]
        width = max(1, round(w * height / h))
        scaled.append(np.asarray(Image.fromarray(image).resize((width, height), Image.NEAREST)))
    total = sum(s.shape[1] for s in scaled) + gap * (len(scaled) - 1)
    out = np.full((height, total, 3), 30, np.uint8)
    x = 0
    for s in scaled:
        out[:, x:x + s.shape[1]] = s
        x += s.shape[1] + gap
    return out
