"""A small GGUF reader: metadata, tensor index and dequantization.

Only what pyserve needs to turn a llama-family GGUF file into a Hugging Face
model directory: the key/value metadata and tensors stored as F32, F16, BF16,
Q8_0, Q4_0 or Q4_1.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF metadata value types
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9

# GGML tensor types: name, elements per block, bytes per block
_TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), as Hugging Face stores it
    type_name: str
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._buf = memoryview(self.path.read_bytes())
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file")
        self._pos = 4
        version = self._read("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors = self._read("<Q")
        n_kv = self._read("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._read_string()
            self.metadata[key] = self._read_value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._read_string()
            n_dims = self._read("<I")
            dims = [self._read("<Q") for _ in range(n_dims)]
            type_id = self._read("<I")
            offset = self._read("<Q")
            infos.append((name, dims, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, offset in infos:
            if type_id not in _TENSOR_TYPES:
                raise ValueError(f"tensor {name}: GGML type {type_id} is not supported")
            type_name, block, block_bytes = _TENSOR_TYPES[type_id]
            count = int(np.prod(dims))
            self.tensors[name] = GGUFTensor(
                name=name,
                shape=tuple(reversed(dims)),  # GGUF lists the innermost dimension first
                type_name=type_name,
                offset=data_start + offset,
                nbytes=count // block * block_bytes,
            )

    def _read(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        n = self._read("<Q")
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _read_value(self, value_type: int):
        if value_type in _SCALARS:
            return self._read(_SCALARS[value_type])
        if value_type == _STRING:
            return self._read_string()
        if value_type == _ARRAY:
            item_type = self._read("<I")
            count = self._read("<Q")
            return [self._read_value(item_type) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {value_type}")

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in Hugging Face layout."""
        t = self.tensors[name]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return _dequantize(raw, t.type_name).reshape(t.shape)

    def q4_1_groups(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A Q4_1 matrix as stored, without dequantizing: codes uint8 [rows,
        cols] (0..15), and per group of 32 columns the scale d and minimum m
        as float32 [rows, cols / 32]; the weight is d * code + m."""
        t = self.tensors[name]
        if t.type_name != "Q4_1":
            raise ValueError(f"tensor {name} is {t.type_name}, not Q4_1")
        rows, cols = t.shape
        blocks = np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(-1, 20)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32)
        qs = blocks[:, 4:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(rows, cols)
        return codes, d, m


def _dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "F32":
        return raw.view(np.float32).copy()
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if type_name == "Q8_0":  # block: f16 scale, 32 x int8
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    if type_name in ("Q4_0", "Q4_1"):
        # Q4_0 block: f16 scale, 16 bytes of nibbles; value = d * (q - 8)
        # Q4_1 block: f16 scale, f16 min, 16 bytes of nibbles; value = d * q + m
        # Low nibbles hold elements 0..15 of the block, high nibbles 16..31.
        width = 18 if type_name == "Q4_0" else 20
        blocks = raw.reshape(-1, width)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, width - 16 :]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if type_name == "Q4_0":
            return (d * (q - 8.0)).reshape(-1)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        return (d * q + m).reshape(-1)
    raise ValueError(f"GGML type {type_name} is not supported")
