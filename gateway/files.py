"""The Files API's storage: in Redis (default) or in a directory every gateway shares.

Files hold batch inputs and the batches' output and error files. They are kept ``ttl``
seconds (``expires_at`` says when) and are at most ``max_bytes`` each, so a client cannot
fill the queue's Redis. In Redis a file is a hash ``P:gw:file:ID`` (its meta) and a string
``P:gw:file:ID:data`` (its bytes, read in ``CHUNK``-sized ranges), and the zset
``P:gw:files`` lists them; in a directory it is ``ID.json`` + ``ID.data``, written atomically
(rename) and treated as gone once expired. Downloads stream chunk by chunk from either, so a
gateway holds a chunk per download, never a whole file. Uploads arrive the same way
(``writer``): each piece is appended to the file's bytes (``P:gw:file:ID:data``, expiring in
PART_TTL until the upload commits, or ``.ID.part.*`` in the directory), which become a file only
when the upload is whole and within its quotas and its meta is written.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
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
    owner: str = ""  # the tenant (API key fingerprint) that made it; never shown

    def to_json(self) -> dict[str, Any]:
        shown = {k: v for k, v in asdict(self).items() if k != "owner"}
        return {**shown, "object": "file", "status": "processed", "status_details": None}

    @property
    def expired(self) -> bool:
        return self.expires_at <= time.time()


CHUNK = 1 << 20  # bytes of a file read at once when it is streamed out
PART_TTL = 3600  # seconds an unfinished upload's bytes outlive a gateway that died mid-upload
FILE_ID_RE = re.compile(r"^file-[A-Za-z0-9_-]{1,128}$")  # ours: file-HEX, file-BATCH-output


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def valid_file_id(file_id: str) -> bool:
    """Whether ``file_id`` could name a file this gateway made; anything else is no file (so
    no id reaches a path or a key: no NUL, no 5,000-character names, no separators)."""
    return FILE_ID_RE.match(file_id) is not None


def file_object(raw: bytes | str) -> FileObject | None:
    """A stored file's metadata; None for a record that is not one (a stray file)."""
    try:
        meta = json.loads(raw)
        return FileObject(**meta) if isinstance(meta, dict) else None
    except (ValueError, TypeError):
        return None


class FileStore:
    """Common interface; ``put`` with a given id overwrites (batch outputs are re-finalizable)."""

    def __init__(self, ttl: int):
        self.ttl = ttl

    def _object(self, data: bytes, filename: str, purpose: str, file_id: str | None,
                owner: str) -> FileObject:
        now = int(time.time())
        return FileObject(file_id or new_file_id(), len(data), now, now + self.ttl, filename,
                          purpose, owner)

    async def put(self, data: bytes, filename: str, purpose: str,
                  file_id: str | None = None, owner: str = "") -> FileObject:
        raise NotImplementedError

    def writer(self) -> FileWriting:
        """A new file written piece by piece (an upload as it arrives); ``commit`` makes it
        visible, ``abort`` drops what was written."""
        raise NotImplementedError

    async def meta(self, file_id: str) -> FileObject | None:
        raise NotImplementedError

    async def content(self, file_id: str) -> bytes | None:
        raise NotImplementedError

    async def stream(self, file_id: str) -> AsyncIterator[bytes] | None:
        """The file's bytes in chunks of at most ``CHUNK``; None if there is no such file."""
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

    def data_key(self, file_id: str) -> str:
        return f"{self.key(file_id)}:data"

    async def put(self, data: bytes, filename: str, purpose: str,
                  file_id: str | None = None, owner: str = "") -> FileObject:
        obj = self._object(data, filename, purpose, file_id, owner)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(obj.id), self.data_key(obj.id))
        pipe.hset(self.key(obj.id), mapping={"meta": json.dumps(asdict(obj))})
        pipe.set(self.data_key(obj.id), data, ex=self.ttl)
        pipe.expire(self.key(obj.id), self.ttl)
        pipe.zadd(self.index, {obj.id: obj.created_at})
        pipe.zremrangebyscore(self.index, "-inf", time.time() - self.ttl)
        await pipe.execute()
        return obj

    def writer(self) -> RedisFileWriting:
        return RedisFileWriting(self, new_file_id())

    async def _commit(self, obj: FileObject, written: bool) -> None:
        """``obj``'s meta, its bytes' lifetime (``written`` by the upload, else empty) and its
        index entry, in one transaction: the file exists from here on."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(obj.id))
        pipe.hset(self.key(obj.id), mapping={"meta": json.dumps(asdict(obj))})
        if written:
            pipe.expire(self.data_key(obj.id), self.ttl)
        else:
            pipe.set(self.data_key(obj.id), b"", ex=self.ttl)
        pipe.expire(self.key(obj.id), self.ttl)
        pipe.zadd(self.index, {obj.id: obj.created_at})
        pipe.zremrangebyscore(self.index, "-inf", time.time() - self.ttl)
        await pipe.execute()

    async def meta(self, file_id: str) -> FileObject | None:
        if not valid_file_id(file_id):
            return None
        raw = await self.r.hget(self.key(file_id), "meta")
        return file_object(raw) if raw else None

    async def content(self, file_id: str) -> bytes | None:
        if not valid_file_id(file_id):
            return None
        data = await self.r.get(self.data_key(file_id))
        return data if data is not None else await self.r.hget(self.key(file_id), "data")

    async def stream(self, file_id: str) -> AsyncIterator[bytes] | None:
        obj = await self.meta(file_id)
        if obj is None:
            return None
        if not await self.r.exists(self.data_key(file_id)):  # a record from before chunking
            data = await self.r.hget(self.key(file_id), "data")
            return None if data is None else _one(data)
        return self._ranges(file_id, obj.bytes)

    async def _ranges(self, file_id: str, size: int) -> AsyncIterator[bytes]:
        for start in range(0, size, CHUNK):
            chunk = await self.r.getrange(self.data_key(file_id), start, start + CHUNK - 1)
            if not chunk:  # expired or deleted meanwhile
                return
            yield chunk

    async def delete(self, file_id: str) -> bool:
        if not valid_file_id(file_id):
            return False
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(file_id), self.data_key(file_id))
        pipe.zrem(self.index, file_id)
        deleted, _ = await pipe.execute()
        return bool(deleted)

    async def list(self) -> list[FileObject]:
        ids = [i.decode() for i in await self.r.zrevrange(self.index, 0, -1)]
        pipe = self.r.pipeline(transaction=False)
        for file_id in ids:
            pipe.hget(self.key(file_id), "meta")
        objs = [file_object(raw) for raw in await pipe.execute() if raw]
        return [o for o in objs if o is not None]


class DirFileStore(FileStore):
    def __init__(self, directory: str | Path, ttl: int):
        super().__init__(ttl)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _paths(self, file_id: str) -> tuple[Path, Path]:
        if not valid_file_id(file_id):
            raise ValueError("not a file id")
        return self.dir / f"{file_id}.json", self.dir / f"{file_id}.data"

    async def put(self, data: bytes, filename: str, purpose: str,
                  file_id: str | None = None, owner: str = "") -> FileObject:
        obj = self._object(data, filename, purpose, file_id, owner)
        meta, body = self._paths(obj.id)
        await asyncio.to_thread(_write_atomic, body, data)
        await asyncio.to_thread(_write_atomic, meta, json.dumps(asdict(obj)).encode())
        return obj

    def writer(self) -> DirFileWriting:
        self._prune_parts()
        return DirFileWriting(self, new_file_id())

    def _prune_parts(self) -> None:
        """Drop the part files of uploads a gateway died during (older than PART_TTL)."""
        stale = time.time() - PART_TTL
        for part in self.dir.glob(".file-*.part.*"):
            try:
                if part.stat().st_mtime < stale:
                    part.unlink()
            except OSError:
                pass

    async def meta(self, file_id: str) -> FileObject | None:
        try:
            meta, _ = self._paths(file_id)
            obj = file_object(await asyncio.to_thread(meta.read_bytes))
        except (OSError, ValueError):
            return None
        if obj is None or obj.id != file_id:  # a stray *.json, not one of ours
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

    async def stream(self, file_id: str) -> AsyncIterator[bytes] | None:
        if await self.meta(file_id) is None:
            return None
        try:
            f = await asyncio.to_thread(self._paths(file_id)[1].open, "rb")
        except OSError:
            return None
        return _read_chunks(f)

    async def delete(self, file_id: str) -> bool:
        if await self.meta(file_id) is None:  # only our own records (meta drops expired ones)
            return False
        paths = self._paths(file_id)
        found = False
        for path in paths:
            try:
                path.unlink()
                found = True
            except OSError:
                pass
        return found

    async def list(self) -> list[FileObject]:
        objs = [await self.meta(p.stem) for p in self.dir.glob("file-*.json")
                if valid_file_id(p.stem)]
        return sorted((o for o in objs if o), key=lambda o: -o.created_at)


class FileWriting:
    """One file being written: ``write`` pieces, then ``commit`` (the file appears) or
    ``abort`` (its bytes are dropped)."""

    def __init__(self, store: FileStore, file_id: str):
        self.store, self.id, self.size = store, file_id, 0

    async def write(self, chunk: bytes) -> None:
        raise NotImplementedError

    async def commit(self, filename: str, purpose: str, owner: str = "") -> FileObject:
        raise NotImplementedError

    async def abort(self) -> None:
        raise NotImplementedError

    def _object(self, filename: str, purpose: str, owner: str) -> FileObject:
        now = int(time.time())
        return FileObject(self.id, self.size, now, now + self.store.ttl, filename, purpose,
                          owner)


class RedisFileWriting(FileWriting):
    """Pieces APPENDed to the file's data key, which expires in PART_TTL unless the upload
    commits (so a gateway that dies mid-upload leaves nothing for good) and is no file until
    its meta exists (``meta``, ``stream`` and ``list`` read the meta first)."""

    store: RedisFileStore

    @property
    def data(self) -> str:
        return self.store.data_key(self.id)

    async def write(self, chunk: bytes) -> None:
        pipe = self.store.r.pipeline(transaction=False)
        pipe.append(self.data, chunk)
        pipe.expire(self.data, PART_TTL)
        await pipe.execute()
        self.size += len(chunk)

    async def commit(self, filename: str, purpose: str, owner: str = "") -> FileObject:
        obj = self._object(filename, purpose, owner)
        await self.store._commit(obj, written=self.size > 0)
        return obj

    async def abort(self) -> None:
        await self.store.r.delete(self.data)


class DirFileWriting(FileWriting):
    """Pieces written to a hidden temporary file, renamed into place on commit."""

    store: DirFileStore

    def __init__(self, store: DirFileStore, file_id: str):
        super().__init__(store, file_id)
        self.tmp = store.dir / f".{file_id}.part.{os.getpid()}"
        self.f: Any = None

    async def write(self, chunk: bytes) -> None:
        if self.f is None:
            self.f = await asyncio.to_thread(self.tmp.open, "wb")
        await asyncio.to_thread(self.f.write, chunk)
        self.size += len(chunk)

    async def commit(self, filename: str, purpose: str, owner: str = "") -> FileObject:
        obj = self._object(filename, purpose, owner)
        meta, body = self.store._paths(self.id)
        await asyncio.to_thread(self._finish, body)
        await asyncio.to_thread(_write_atomic, meta, json.dumps(asdict(obj)).encode())
        return obj

    def _finish(self, body: Path) -> None:
        if self.f is None:
            self.tmp.write_bytes(b"")
        else:
            self.f.close()
        os.replace(self.tmp, body)

    async def abort(self) -> None:
        if self.f is not None:
            await asyncio.to_thread(self.f.close)
        self.tmp.unlink(missing_ok=True)


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _read_chunks(f: Any) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            yield chunk
    finally:
        f.close()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
