"""Routes: the Files API (``/v1/files``) and the Batch API (``/v1/batches``).

Uploads are JSONL with purpose ``batch``, at most ``max_file_bytes`` (413 above), within the
key's and the gateway's file quotas (403), streamed to the store as they arrive. A batch is
created ``validating`` and driven by whichever gateway holds its lease (batches.py); these
routes only read its state and record a cancel request.

Every file and batch belongs to the API key (the tenant) that made it; another key gets a 404
as if it did not exist, an admin key sees them all (``Tenant.sees``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedq.gateway.api_errors import APIError, bad_request, not_found, too_large
from pagedq.gateway.batch_store import TERMINAL, BatchState, completion_hours, new_batch
from pagedq.gateway.files import FileObject
from pagedq.gateway.openai import BatchCreateRequest
from pagedq.gateway.state import Tenant, gateway, tenant
from pagedq.gateway.translate import ENDPOINTS
from pagedq.gateway.uploads import Upload, UploadOverLimit, read_upload
from pagedq.worker.config import GatewayConfig

router = APIRouter()
PURPOSES = ("batch",)


UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": list(PURPOSES)}}}}}}}


@router.post("/v1/files", openapi_extra=UPLOAD_BODY)  # the form is read by hand (size limits)
async def upload_file(request: Request) -> Response:
    """The file is read as it arrives and written to the store in pieces (uploads.py): the
    gateway never holds it whole, and an upload past the file limit or a quota stops there."""
    gw, owner = gateway(request), tenant(request).owner
    room = await _room(gw.config, await gw.files.list(), owner)
    writer = gw.files.writer()
    try:
        upload = await read_upload(request.headers.get("content-type", ""), request.stream(),
                                   writer, room.bytes)
        purpose = _check_form(upload)
    except UploadOverLimit:
        await writer.abort()
        raise room.refusal() from None
    except BaseException:
        await writer.abort()
        raise
    obj = await writer.commit(upload.filename or "upload.jsonl", purpose, owner=owner)
    return JSONResponse(obj.to_json())


def _check_form(upload: Upload) -> str:
    """The form's purpose, once it is known to hold a file under 'file' and a valid purpose."""
    if upload.filename is None or upload.file_field != "file":
        raise bad_request("send the file as multipart form field 'file'", "file")
    purpose = upload.fields.get("purpose")
    if purpose not in PURPOSES:
        raise bad_request(f"purpose must be one of {list(PURPOSES)}, got {purpose!r}", "purpose")
    return purpose


@router.get("/v1/files")
async def list_files(request: Request) -> Response:
    who = tenant(request)
    objs = [o for o in await gateway(request).files.list() if who.sees(o.owner)]
    return JSONResponse({"object": "list", "data": [o.to_json() for o in objs],
                         "has_more": False})


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> Response:
    return JSONResponse((await _file(request, file_id)).to_json())


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    obj = await _file(request, file_id)
    chunks = await gateway(request).files.stream(file_id)
    if chunks is None:
        raise _no_file(file_id)
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"Content-Length": str(obj.bytes)})


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> Response:
    await _file(request, file_id)
    if not await gateway(request).files.delete(file_id):
        raise _no_file(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@dataclass(frozen=True)
class Room:
    """How many bytes an upload may hold, and which limit says so (the file size: 413; the
    key's or the gateway's quota: 403)."""

    bytes: int
    refusal: Callable[[], APIError]


async def _room(config: GatewayConfig, files: list[FileObject], owner: str) -> Room:
    """What the tenant's quota (--max-files, --max-files-bytes) and the gateway's, all keys
    together (--max-total-files, --max-total-files-bytes), leave for one more file; 403 at once
    when no file may be added. (Checked at upload: two racing uploads may both pass; the next
    one is refused.)"""
    mine = [o for o in files if o.owner == owner]
    used, total = sum(o.bytes for o in mine), sum(o.bytes for o in files)
    key_quota = Quota("this key", len(mine), used, config.max_files, config.max_files_bytes,
                      "--max-files, --max-files-bytes")
    all_quota = Quota("this gateway (all keys together)", len(files), total,
                      config.max_total_files, config.max_total_files_bytes,
                      "--max-total-files, --max-total-files-bytes")
    for quota in (key_quota, all_quota):
        if quota.count + 1 > quota.max_count or quota.left <= 0:
            raise quota.refused()
    tightest = min((key_quota, all_quota), key=lambda q: q.left)
    if config.max_file_bytes <= tightest.left:
        return Room(config.max_file_bytes, lambda: too_large(config.max_file_bytes))
    return Room(tightest.left, tightest.refused)


@dataclass(frozen=True)
class Quota:
    """One quota's reading: whose (a key, or the whole gateway), what it holds, its bounds and
    the flags that set them (named in the 403, so an operator knows what to raise)."""

    who: str
    count: int
    used: int
    max_count: int
    max_bytes: int
    flags: str

    @property
    def left(self) -> int:
        return self.max_bytes - self.used

    def refused(self) -> APIError:
        return APIError(403, f"{self.who} keeps {self.count} files of {self.used} bytes; the "
                        f"quota is {self.max_count} files and {self.max_bytes} bytes "
                        f"({self.flags}): delete files first", "invalid_request_error",
                        "quota_exceeded")


async def _file(request: Request, file_id: str) -> FileObject:
    """The file, if the caller's tenant sees it; else 404, as for a file that never was."""
    obj = await gateway(request).files.meta(file_id)
    if obj is None or not tenant(request).sees(obj.owner):
        raise _no_file(file_id)
    return obj


async def _batch(request: Request, batch_id: str) -> BatchState:
    state = await gateway(request).batches.load(batch_id)
    if state is None or not tenant(request).sees(state.owner):
        raise _no_batch(batch_id)
    return state


@router.post("/v1/batches")
async def create_batch(req: BatchCreateRequest, request: Request) -> Response:
    gw = gateway(request)
    if req.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {sorted(ENDPOINTS)}", "endpoint")
    hours = completion_hours(req.completion_window)
    meta = await gw.files.meta(req.input_file_id)
    if meta is None or meta.purpose != "batch" or not tenant(request).sees(meta.owner):
        raise bad_request(f"input_file_id {req.input_file_id} is not an uploaded batch file",
                          "input_file_id", "invalid_input_file")
    obj = new_batch("batch_" + uuid.uuid4().hex, req, hours)
    await gw.batches.create(obj, owner=_owner_of_new(tenant(request), meta))
    return JSONResponse(obj)


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
    if not 1 <= limit <= 100:
        raise bad_request("limit must be in [1, 100]", "limit")
    data, more = await gateway(request).batches.list(after, limit, tenant(request).sees)
    return JSONResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> Response:
    return JSONResponse((await _batch(request, batch_id)).obj)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> Response:
    store = gateway(request).batches
    state = await _batch(request, batch_id)
    if state.obj["status"] in TERMINAL:
        raise APIError(400, f"batch {batch_id} is already {state.obj['status']}",
                       "invalid_request_error", "invalid_state")
    await store.request_cancel(batch_id)
    state = await store.load(batch_id)
    assert state is not None
    return JSONResponse(state.obj)


def _owner_of_new(who: Tenant, input_file: FileObject) -> str:
    """A batch is its maker's; an admin's batch over a tenant's file is that tenant's."""
    return input_file.owner if who.admin and who.owner != input_file.owner else who.owner


def _no_file(file_id: str) -> APIError:
    return not_found(f"No such file: {file_id}", "file_not_found", "file_id")


def _no_batch(batch_id: str) -> APIError:
    return not_found(f"No such batch: {batch_id}", "batch_not_found", "batch_id")
