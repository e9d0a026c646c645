"""Images without ROS or cv_bridge: raw image buffers <-> numpy, camera sources, annotated frames.

The nodes pass message fields in (encoding, height, width, step, data) and get arrays out, so
every conversion is a plain function with plain tests.
"""
from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass

import numpy as np

# encoding -> (channels, order of the channels to get RGB)
_ENCODINGS = {
    "rgb8": (3, (0, 1, 2)),
    "bgr8": (3, (2, 1, 0)),
    "rgba8": (4, (0, 1, 2)),
    "bgra8": (4, (2, 1, 0)),
    "mono8": (1, (0, 0, 0)),
    "8UC3": (3, (2, 1, 0)),  # OpenCV's default channel order
}
SUPPORTED_ENCODINGS = tuple(_ENCODINGS)


class ImageFormatError(ValueError):
    """An image message cannot be turned into an RGB array; the message says why."""


def rgb_from_raw(encoding: str, height: int, width: int, step: int, data) -> np.ndarray:
    """An (H, W, 3) uint8 RGB copy of a raw image buffer (sensor_msgs/Image fields)."""
    if encoding not in _ENCODINGS:
        raise ImageFormatError(f"unsupported image encoding {encoding!r}; supported: {', '.join(SUPPORTED_ENCODINGS)}")
    channels, order = _ENCODINGS[encoding]
    if height <= 0 or width <= 0:
        raise ImageFormatError(f"empty image ({width}x{height})")
    if step < width * channels:
        raise ImageFormatError(f"step {step} is smaller than width*channels = {width * channels}")
    buf = np.frombuffer(bytes(data) if not isinstance(data, (bytes, bytearray, memoryview)) else data, np.uint8)
    if buf.size < step * height:
        raise ImageFormatError(f"{buf.size} data bytes, expected step*height = {step * height}")
    rows = buf[: step * height].reshape(height, step)[:, : width * channels].reshape(height, width, channels)
    return np.ascontiguousarray(rows[:, :, list(order)])


def raw_from_rgb(image: np.ndarray, encoding: str = "rgb8") -> tuple[int, int, int, bytes]:
    """(height, width, step, data) of an RGB array in ``encoding`` (rgb8 or bgr8)."""
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ImageFormatError(f"expected an (H, W, 3) uint8 RGB array, got {image.shape} {image.dtype}")
    if encoding == "bgr8":
        image = image[:, :, ::-1]
    elif encoding != "rgb8":
        raise ImageFormatError(f"can only write rgb8 or bgr8, not {encoding!r}")
    h, w = image.shape[:2]
    return h, w, 3 * w, np.ascontiguousarray(image).tobytes()


def rgb_from_compressed(data) -> np.ndarray:
    """Decode a CompressedImage payload (JPEG/PNG) to RGB."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
        raise ImageFormatError(f"cannot decode compressed image: {exc}") from exc


def jpeg_bytes(image: np.ndarray, quality: int = 85) -> bytes:
    """JPEG of an RGB array (for sensor_msgs/CompressedImage, format 'jpeg')."""
    from PIL import Image
    out = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(out, format="JPEG", quality=quality)
    return out.getvalue()


@dataclass(frozen=True)
class CameraSource:
    """Where OpenCV reads frames: kind is 'device' (value int), 'gstreamer', 'url' or 'file'."""

    kind: str
    value: int | str


def parse_camera_source(source: str) -> CameraSource:
    """Classify the camera node's ``source`` parameter: a device index ('0'), a GStreamer pipeline
    (contains '!', e.g. the Go2's ``udpsrc address=230.1.1.1 port=1720 ! ... ! appsink``), a URL
    (rtsp://, http://) or a video file path."""
    text = str(source).strip()
    if not text:
        raise ValueError("camera source is empty: give a device index (0), a video file, or a GStreamer pipeline")
    if text.isdigit():
        return CameraSource("device", int(text))
    if "!" in text:
        return CameraSource("gstreamer", text)
    if "://" in text:
        return CameraSource("url", text)
    return CameraSource("file", text)


def annotate(image: np.ndarray, title: str, lines: list[str], width: int = 448) -> np.ndarray:
    """The frame scaled (nearest) to ``width`` pixels wide with a caption band below it: a bold-ish
    ``title`` line (the action) and wrapped ``lines`` (reasoning, latency, mode)."""
    from PIL import Image, ImageDraw

    image = np.asarray(image, dtype=np.uint8)
    h, w = image.shape[:2]
    height = max(1, round(h * width / w))
    frame = Image.fromarray(image).resize((width, height), Image.NEAREST)
    font_px = max(12, width // 32)
    chars = max(20, int(width / (font_px * 0.55)))
    wrapped: list[str] = []
    for line in lines:
        wrapped.extend(textwrap.wrap(line, chars) or [""])
    band = (len(wrapped) + 1) * (font_px + 4) + 10
    canvas = Image.new("RGB", (width, height + band), (20, 20, 24))
    canvas.paste(frame, (0, 0))
    draw = ImageDraw.Draw(canvas)
    y = height + 5
    draw.text((6, y), title, fill=(120, 255, 140), font_size=font_px + 2)
    y += font_px + 6
    for line in wrapped:
        draw.text((6, y), line, fill=(235, 235, 235), font_size=font_px)
        y += font_px + 4
    return np.asarray(canvas, dtype=np.uint8).copy()
