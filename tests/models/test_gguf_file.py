"""The lean GGUF reader against the ``gguf`` package's GGUFReader (the oracle): the same tensor
table, the same bytes per tensor and the same scalar metadata, on files with every block type,
float tensors, and string, array and scalar metadata of every kind."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from pagedq.errors import ModelNotFoundError
from pagedq.worker.models.gguf_file import read_index
from tests.gguf_files import ALL_TYPES, write_gguf


def assert_same_as_reader(path) -> None:
    index = read_index(path)
    reader = GGUFReader(str(path))
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    with open(path, "rb") as fh:
        for info, tensor in zip(index.tensors, reader.tensors, strict=True):
            assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
            assert info.code == int(tensor.tensor_type)
            assert info.nbytes == int(tensor.n_bytes)
            assert index.read(info, fh).numpy().tobytes() == np.asarray(tensor.data).tobytes()
    for key, field in reader.fields.items():
        if field.types[0] == GGUFValueType.ARRAY or key.startswith("GGUF."):
            assert key not in index.metadata
            continue
        value = field.contents()
        assert index.metadata[key] == pytest.approx(value) if isinstance(value, float) else \
            index.metadata[key] == value


@pytest.mark.parametrize("weight_type", ["F32", *ALL_TYPES])
def test_tensor_table_and_bytes_match_gguf(tiny_model_dir, tmp_path, weight_type):
    model = tiny_model_dir("llama", hidden_size=256, intermediate_size=512)  # K-quants: K % 256
    path = write_gguf(model, tmp_path / "m.gguf", weight_type)
    assert_same_as_reader(path)
    index = read_index(path)
    assert index.architecture == "llama" and index.arch_int("attention.head_count") is not None


def test_metadata_of_every_kind_is_read_or_skipped(tmp_path):
    """Strings and arrays (of strings, of numbers, nested) are skipped by length; scalars of
    every type are kept."""
    path = tmp_path / "meta.gguf"
    w = GGUFWriter(str(path), "qwen3")
    w.add_token_list(["a", "bb", "ccc", "é✓"] * 50)
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_string("test.name", "tiny ✓")
    for kind, value in (("uint8", 7), ("int8", -7), ("uint16", 700), ("int16", -700),
                        ("int32", -70000), ("uint64", 1 << 40), ("int64", -(1 << 40)),
                        ("float32", 0.5), ("float64", 0.25), ("bool", True)):
        getattr(w, f"add_{kind}")(f"test.{kind}", value)
    w.add_tensor("blk.0.attn_norm.weight", np.arange(24, dtype=np.float32))
    w.add_tensor("token_embd.weight", np.arange(96, dtype=np.float16).reshape(3, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_as_reader(path)
    index = read_index(path)
    assert index.metadata["test.name"] == "tiny ✓" and index.metadata["test.bool"] is True
    assert index.tensors[1].shape == (3, 32) and index.tensors[0].offset % 32 == 0
    arrays = ("tokenizer.ggml.tokens", "test.ints", "test.nested")
    named = read_index(path, arrays)  # asked-for arrays come back as lists, the rest as before
    reader = GGUFReader(str(path))
    assert {k: named.metadata[k] for k in arrays[:2]} == \
        {k: reader.fields[k].contents() for k in arrays[:2]}
    assert named.metadata["test.nested"] == [[1, 2], [3]]  # GGUFReader flattens nested arrays
    assert {k: v for k, v in named.metadata.items() if k not in arrays} == index.metadata


def test_the_bundled_gguf_reads_as_gguf_does():
    from pagedq.worker.models.default_model import default_gguf

    assert_same_as_reader(default_gguf())


def test_not_a_gguf_says_so(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF"):
        read_index(bad)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little"))
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF"):
        read_index(truncated)
