"""The Files API's storage: in Redis (default) or in a directory every gateway shares.

Files hold batch inputs and the batches' output and error files. They are kept ``ttl``
seconds (``expires_at`` says when) and are at most ``max_bytes`` each, so a client cannot
fill the queue's Redis. In Redis a file is one hash ``P:gw:file:ID`` (meta + data) and the
zset ``P:gw:files`` lists them; in a directory it is ``ID.json`` + ``ID.data``, written
atomically (rename) and treated as gone once expired.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis


@dataclass
class FileObject:
    id: str
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "object": "file", "status": "processed", "status_details": None}

    @property
    def expired(self) -> bool:
        return self.expires_at <= time.time()


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


class FileStore:
    """Common interface; ``put`` with a given id overwrites (batch outputs are re-finalizable)."""

    def __init__(self, ttl: int):
        self.ttl = ttl

    def _object(self, data: bytes, filename: str, purpose: str, file_id: str | None) -> FileObject:
        now = int(time.time())
        return FileObject(file_id or new_file_id(), len(data), now, now + self.ttl, filename,
                          purpose)

    async def put(self, data: bytes, filename: str, purpose: str,
                  file_id: str | None = None) -> FileObject:
        raise NotImplementedError

    async def meta(self, file_id: str) -> FileObject | None:
        raise NotImplementedError

    async def content(self, file_id: str) -> bytes | None:
        raise NotImplementedError

    async def delete(self, file_id: str) -> bool:
        raise NotImplementedError

    async def list(self) -> list[FileObject]:
        raise NotImplementedError


class RedisFileStore(FileStore):
    def __init__(self, r: Redis, prefix: str, ttl: int):
        super().__init__(ttl)
        self.r = r
        self.index = f"{prefix}:gw:files"
        self.prefix = prefix

    def key(self, file_id: str) -> str:
        return f"{self.prefix}:gw:file:{file_id}"

    async def put(self, data: bytes, filename: str, purpose: str,
                  file_id: str | None = None) -> FileObject:
        obj = self._object(data, filename, purpose, file_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(obj.id))
        pipe.hset(self.key(obj.id), mapping={"meta": json.dumps(asdict(obj)), "data": data})
        pipe.expire(self.key(obj.id), self.ttl)
        pipe.zadd(self.index, {obj.id: obj.created_at})
        pipe.zremrangebyscore(self.index, "-inf", time.time() - self.ttl)
        await pipe.execute()
        return obj

    async def meta(self, file_id: str) -> FileObject | None:
        raw = await self.r.hget(self.key(file_id), "meta")
        return FileObject(**json.loads(raw)) if raw else None

    async def content(self, file_id: str) -> bytes | None:
        return await self.r.hget(self.key(file_id), "data")

    async def delete(self, file_id: str) -> bool:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(file_id))
        pipe.zrem(self.index, file_id)
        deleted, _ = await pipe.execute()
        return bool(deleted)

    async def list(self) -> list[FileObject]:
        ids = [i.decode() for i in await self.r.zrevrange(self.index, 0, -1)]
        pipe = self.r.pipeline(transaction=False)
        for file_id in ids:
            pipe.hget(self.key(file_id), "meta")
        return [FileObject(**json.loads(raw)) for raw in await pipe.execute() if raw]


class DirFileStore(FileStore):
    def __init__(self, directory: str | Path, ttl: int):
        super().__init__(ttl)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _paths(self, file_id: str) -> tuple[Path, Path]:
        if "/" in file_id or file_id.startswith("."):
            raise ValueError(f"bad file id {file_id!r}")
        return self.dir / f"{file_id}.json", self.dir / f"{file_id}.data"

    async def put(self, data: bytes, filename: str, purpose: str,
                  file_id: str | None = None) -> FileObject:
        obj = self._object(data, filename, purpose, file_id)
        meta, body = self._paths(obj.id)
        await asyncio.to_thread(_write_atomic, body, data)
        await asyncio.to_thread(_write_atomic, meta, json.dumps(asdict(obj)).encode())
        return obj

    async def meta(self, file_id: str) -> FileObject | None:
        try:
            meta, _ = self._paths(file_id)
            obj = FileObject(**json.loads(await asyncio.to_thread(meta.read_bytes)))
        except (OSError, ValueError):
            return None
        if obj.expired:
            await self.delete(file_id)
            return None
        return obj

    async def content(self, file_id: str) -> bytes | None:
        if await self.meta(file_id) is None:
            return None
        try:
            return await asyncio.to_thread(self._paths(file_id)[1].read_bytes)
        except OSError:
            return None

    async def delete(self, file_id: str) -> bool:
        try:
            paths = self._paths(file_id)
        except ValueError:
            return False
        found = False
        for path in paths:
            try:
                path.unlink()
                found = True
            except FileNotFoundError:
                pass
        return found

    async def list(self) -> list[FileObject]:
        objs = [await self.meta(p.stem) for p in self.dir.glob("*.json")]
        return sorted((o for o in objs if o), key=lambda o: -o.created_at)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
