"""Adapter administration: list, load and unload at run time (vLLM's request shapes), pin and
unpin. With an API-key file, only admin keys may call these."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from lora_guard.engine.errors import UnknownAdapterError
from lora_guard.engine.llm_engine import LLMEngine
from lora_guard.engine.lora import AdapterError
from lora_guard.engine.lora.registry import valid_adapter_id
from lora_guard.engine.threads import serially
from lora_guard.server.auth import require_admin
from lora_guard.server.errors import APIError, not_found, validation
from lora_guard.server.state import ServerState
from lora_guard.server.state import state_of as _state

router = APIRouter(prefix="/v1")


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str | None = None


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


def _admin(request: Request) -> ServerState:
    state = _state(request)
    require_admin(state.keys, getattr(request.state, "api_key", None), "adapter administration")
    return state


def _name(name: str) -> str:
    if not valid_adapter_id(name):
        raise validation(f"invalid adapter id {name!r}: use letters, digits, '-', '_' and '.'")
    return name


def _inside_adapter_dirs(state: ServerState, name: str, path: str | None) -> tuple[Path, Path]:
    """The adapter's folder, resolved, and the adapter directory it lies in; only a folder inside
    a configured adapter directory (no `..`, no absolute path elsewhere, no symlink leading out)."""
    roots = [d.expanduser().resolve() for d in state.adapter_dirs]
    if not roots:
        raise APIError(
            403, "no adapter directory is configured: start with --adapter-dir", "forbidden"
        )
    candidates = [Path(path).expanduser()] if path else [root / name for root in roots]
    for candidate in candidates:
        resolved = (candidate if candidate.is_absolute() else roots[0] / candidate).resolve()
        for root in roots:
            if resolved.is_relative_to(root):
                if resolved.is_dir():
                    return resolved, root
                raise not_found(f"no adapter folder at {candidate}")
    raise APIError(403, "lora_path must lie inside the configured adapter directories", "forbidden")


@router.get("/adapters")
async def list_adapters(request: Request) -> list[dict[str, Any]]:
    state = _admin(request)

    def snapshot(engine: LLMEngine) -> list[dict[str, Any]]:
        return [asdict(row) for row in engine.adapter_rows()]

    rows: list[dict[str, Any]] = await state.engine.call(snapshot)
    return rows


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadAdapter, request: Request) -> PlainTextResponse:
    state = _admin(request)
    name = _name(body.lora_name)
    folder, root = _inside_adapter_dirs(state, name, body.lora_path)
    try:  # refuse it now rather than at its first request
        await asyncio.to_thread(serially, state.llm.read_adapter, name, folder, root)
    except AdapterError as exc:
        raise validation(str(exc)) from None
    await state.engine.call(lambda engine: engine.register_adapter(name, folder, root))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadAdapter, request: Request) -> PlainTextResponse:
    state = _admin(request)
    name = _name(body.lora_name)

    try:
        await state.engine.call(lambda engine: engine.unregister_adapter(name))
    except UnknownAdapterError as exc:
        raise not_found(str(exc)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@router.post("/adapters/{adapter_id}/pin")
async def pin(adapter_id: str, request: Request) -> dict[str, Any]:
    return await _pinning(request, adapter_id, pin=True)


@router.post("/adapters/{adapter_id}/unpin")
async def unpin(adapter_id: str, request: Request) -> dict[str, Any]:
    return await _pinning(request, adapter_id, pin=False)


async def _pinning(request: Request, adapter_id: str, *, pin: bool) -> dict[str, Any]:
    state = _admin(request)
    name = _name(adapter_id)

    try:
        pinned = list(await state.engine.call(lambda engine: engine.pin_adapter(name, pin)))
    except UnknownAdapterError as exc:
        raise not_found(str(exc)) from None
    except ValueError as exc:
        raise validation(str(exc)) from None
    return {"pinned": pinned}
