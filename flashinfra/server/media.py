"""Images and video in chat requests: fetch or decode each ``image_url`` / ``video_url`` part, enforce limits,
and turn the rendered chat prompt into token ids plus the engine's ``MultiModalItem``s.

Sources: ``data:<mime>;base64,<data>`` URLs (image/* for images, video/* for videos), or http(s) URLs whose
host is on the server's allow-list (empty by default, so no server-side request forgery): fetched without
following redirects, with a timeout and the byte limit enforced while reading. Anything else (other
schemes, wrong mime types, undecodable data, over a limit, too many parts, a server without vision) is a
400 whose ``param`` names the part, e.g. ``messages[0].content[1].image_url``. Decoding and resizing run
in the server's thread pool, never on the event loop.

What travels to the engine is each item's resized uint8 canvas (see ``flashinfra.multimodal.processor``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from flashinfra.engine.sched.messages import MultiModalItem
from flashinfra.multimodal.inputs import MediaError, MediaLimits, image_input, video_input
from flashinfra.multimodal.processor import Canvas
from flashinfra.multimodal.prompt import TokenIds, build_prompt
from flashinfra.server.errors import bad_request
from flashinfra.server.serving import _MAX_CHARS_PER_TOKEN

IMAGE_MIMES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp", "image/tiff")
VIDEO_MIMES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo", "video/mpeg")
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)((?:;[\w.+-]+=[\w.+-]+)*);base64,(.*)", re.DOTALL)
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaSettings:
    """What a vision-enabled server accepts."""

    token_ids: TokenIds
    limits: MediaLimits = MediaLimits()
    allowed_hosts: tuple[str, ...] = field(default_factory=tuple)  # lower-case host names; empty: data URLs only

    @staticmethod
    def for_model(model_path, limits: MediaLimits = MediaLimits(), allowed_hosts: str | tuple[str, ...] = ()):
        from flashinfra.config import load_config

        hosts = tuple(h.strip().lower() for h in (allowed_hosts.split(",") if isinstance(allowed_hosts, str)
                                                  else allowed_hosts) if h.strip())
        return MediaSettings(TokenIds.from_config(load_config(model_path)), limits, hosts)


@dataclass(frozen=True)
class MediaPart:
    param: str  # e.g. messages[0].content[1].image_url
    kind: str  # "image" | "video"
    url: str


def media_parts(messages) -> list[MediaPart]:
    """The image/video parts of chat messages (``protocol.ChatMessage``), in prompt order."""
    from flashinfra.server.protocol import ImagePart, VideoPart

    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg.content, list):
            continue
        for j, part in enumerate(msg.content):
            if isinstance(part, ImagePart):
                out.append(MediaPart(f"messages[{i}].content[{j}].image_url", "image", part.image_url.url))
            elif isinstance(part, VideoPart):
                out.append(MediaPart(f"messages[{i}].content[{j}].video_url", "video", part.video_url.url))
    return out


def _fetch(url: str, limits: MediaLimits) -> bytes:
    import httpx

    with httpx.Client(follow_redirects=False, timeout=FETCH_TIMEOUT_S) as client:
        with client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise MediaError(f"fetching {url} gave HTTP {resp.status_code}")
            data = bytearray()
            for chunk in resp.iter_bytes():
                data += chunk
                if len(data) > limits.max_bytes:
                    raise MediaError(f"{url} is over the limit of {limits.max_bytes} bytes")
            return bytes(data)


def read_part(part: MediaPart, settings: MediaSettings) -> bytes:
    """The encoded bytes of one part; ``MediaError`` for anything not allowed or not readable."""
    url, limits = part.url.strip(), settings.limits
    if url.startswith("data:"):
        m = _DATA_URL.fullmatch(url)
        if not m:
            raise MediaError("a data URL must look like data:<mime type>;base64,<data>")
        mime = m.group(1).lower()
        allowed = IMAGE_MIMES if part.kind == "image" else VIDEO_MIMES
        if mime not in allowed:
            raise MediaError(f"mime type {mime!r} is not an accepted {part.kind} type ({', '.join(allowed)})")
        payload = m.group(3)
        if len(payload) // 4 * 3 > limits.max_bytes + 2:
            raise MediaError(f"the {part.kind} is about {len(payload) // 4 * 3} bytes, over the limit of "
                             f"{limits.max_bytes}")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data URL's base64 payload is malformed") from None
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        host = (urlsplit(url).hostname or "").lower()
        if host not in settings.allowed_hosts:
            raise MediaError(f"remote {part.kind} URLs from host {host!r} are not allowed on this server "
                             "(send the data inline as a base64 data URL)")
        return _fetch(url, limits)
    raise MediaError(f"unsupported URL scheme {scheme!r}: use a base64 data URL")


def load_part(part: MediaPart, settings: MediaSettings) -> Canvas:
    data = read_part(part, settings)
    return image_input(data, settings.limits) if part.kind == "image" else video_input(data, settings.limits)


def check_parts(parts: list[MediaPart], settings: MediaSettings | None) -> None:
    """The cheap checks, before any decoding: vision enabled, count within the limit."""
    if not parts:
        return
    if settings is None:
        raise bad_request("this server does not accept images or video (start it with --enable-vision)",
                          parts[0].param)
    if len(parts) > settings.limits.max_items:
        raise bad_request(f"{len(parts)} images/videos in one request, over the limit of "
                          f"{settings.limits.max_items}", parts[settings.limits.max_items].param)


def load_parts(parts: list[MediaPart], settings: MediaSettings) -> list[Canvas]:
    canvases = []
    for part in parts:
        try:
            canvases.append(load_part(part, settings))
        except MediaError as exc:
            raise bad_request(f"{part.param}: {exc}", part.param) from None
    return canvases


async def chat_prompt(state, messages, template_messages: list[dict], add_generation_prompt: bool,
                      template_kwargs: dict | None) -> tuple[list[int], list[MultiModalItem]] | None:
    """Token ids and items of a chat request with images/videos; None when it has none (the text path)."""
    parts = media_parts(messages)
    if not parts:
        return None
    settings = getattr(state, "media", None)
    check_parts(parts, settings)
    size = sum(len(m.get("content") or "") for m in template_messages)
    if size > state.max_model_len * _MAX_CHARS_PER_TOKEN:
        raise bad_request(f"the messages are {size} characters long, far beyond this model's maximum context "
                          f"length of {state.max_model_len} tokens", "messages")
    tok = state.tokenizer

    def work():
        canvases = load_parts(parts, settings)
        try:
            text = tok.render_chat(template_messages, add_generation_prompt, template_kwargs)
            return build_prompt(text, canvases, settings.token_ids, lambda t: tok.encode(t, add_special_tokens=False))
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

    return await asyncio.get_running_loop().run_in_executor(state.executor, work)
