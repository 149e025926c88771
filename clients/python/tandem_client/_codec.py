"""Tandem's frame format (rpc/detail/wire.h) and the codec between Python values and tandem.wire.Value.

A message is [u32 little-endian header length][header: a serialized Request or Response][zero padding to a multiple
of 64][tensor bytes, each padded to a multiple of 64 ...]. A tensor is a TensorMeta in the header (dtype as
c10::ScalarType, sizes, byte offset within the payload area, byte count); its bytes follow the header, never inside
protobuf.

Python values and what a registered C++ function receives:
    None -> None, bool -> bool, int -> int (int64), float -> float (double), complex -> complex<double>,
    str -> str (UTF-8), bytes -> str (its bytes), list -> List[T] (T inferred when every item has one simple type,
    else Any), tuple -> Tuple, dict -> Dict[K, V], numpy.ndarray (0-d too) / torch.Tensor -> Tensor; numpy scalars
    (numpy.float32(1), ...) are numbers.
Replies decode the same way back; a tensor arrives as a writable numpy array, or a torch.Tensor when asked for.
"""

import math
import struct

import numpy as np

from ._errors import EncodeError

try:  # optional: torch tensors in and out where PyTorch is installed
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

ALIGN = 64
MAX_NESTING = 32  # rpc/detail/wire.h kMaxNesting
MAX_DIMS = 64
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# c10::ScalarType codes and their numpy dtypes.
_DTYPES = {
    0: np.dtype(np.uint8), 1: np.dtype(np.int8), 2: np.dtype(np.int16), 3: np.dtype(np.int32),
    4: np.dtype(np.int64), 5: np.dtype(np.float16), 6: np.dtype(np.float32), 7: np.dtype(np.float64),
    9: np.dtype(np.complex64), 10: np.dtype(np.complex128), 11: np.dtype(np.bool_),
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
COMPLEX_HALF, BFLOAT16 = 8, 15  # no numpy dtype: torch only
# Same-sized integer dtypes their bytes travel as.
_CARRIER = {COMPLEX_HALF: np.dtype(np.int32), BFLOAT16: np.dtype(np.int16)}
_NAMES = {8: "complex32", 15: "bfloat16"}

if torch is not None:
    _TORCH_CODES = {
        torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
        torch.float32: 6, torch.float64: 7, torch.complex32: 8, torch.complex64: 9, torch.complex128: 10,
        torch.bool: 11, torch.bfloat16: 15,
    }
    _TORCH_DTYPES = {code: dtype for dtype, code in _TORCH_CODES.items()}
    _TORCH_CARRIER = {COMPLEX_HALF: torch.int32, BFLOAT16: torch.int16}


def align_up(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _is_tensor(v):
    return isinstance(v, np.ndarray) or (torch is not None and isinstance(v, torch.Tensor))


def _simple_type(v):
    """The TorchScript annotation of a value of a simple kind, or None."""
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, (int, np.integer)):
        return "int"
    if isinstance(v, (float, np.floating)):
        return "float"
    if isinstance(v, (str, bytes)):
        return "str"
    if _is_tensor(v):
        return "Tensor"
    return None


def _common_type(items):
    """The annotation every item shares ("int", "Tensor", ...), else "Any" (the C++ side accepts both)."""
    types = {_simple_type(v) for v in items}
    return types.pop() if len(types) == 1 and None not in types else "Any"


class Encoder:
    """Encodes values into a Payload and collects the tensors' bytes for the frame."""

    def __init__(self):
        self._buffers = []  # (uint8 view of a contiguous array, its byte count)
        self._offset = 0
        self._seen = {}  # id(tensor) -> index: a tensor given twice is sent once, as the C++ side does
        self._keep = []  # keeps the objects behind _seen's ids alive

    def encode(self, values, payload):
        for i, v in enumerate(values):
            self._value(v, payload.values.add(), payload, f"argument {i + 1}", 0)  # counted from 1, as C++ does

    def frame(self, header):
        head = header.SerializeToString()
        parts = [struct.pack("<I", len(head)), head, bytes(align_up(4 + len(head)) - 4 - len(head))]
        for data, n in self._buffers:
            parts.append(data)
            if align_up(n) != n:
                parts.append(bytes(align_up(n) - n))
        return b"".join(parts)

    def _value(self, v, out, payload, path, depth):
        if depth > MAX_NESTING:
            raise EncodeError(f"{path}: nested more than {MAX_NESTING} deep")
        if v is None:
            out.none = True
        elif isinstance(v, (bool, np.bool_)):
            out.b = bool(v)
        elif isinstance(v, (int, np.integer)):
            if not INT64_MIN <= int(v) <= INT64_MAX:
                raise EncodeError(f"{path}: the integer {v} does not fit in 64 bits")
            out.i = int(v)
        elif isinstance(v, (float, np.floating)):
            out.d = float(v)
        elif isinstance(v, (complex, np.complexfloating)):
            out.c.re, out.c.im = float(v.real), float(v.imag)
        elif isinstance(v, str):
            try:
                out.s = v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise EncodeError(f"{path}: a string that is not valid Unicode ({e.reason})") from None
        elif isinstance(v, (bytes, bytearray, memoryview)):
            out.s = bytes(v)
        elif _is_tensor(v):
            out.tensor = self._tensor(v, payload, path)
        elif isinstance(v, list):
            out.list.SetInParent()
            out.list.elem_type = _common_type(v)
            for i, item in enumerate(v):
                self._value(item, out.list.items.add(), payload, f"{path}[{i}]", depth + 1)
        elif isinstance(v, tuple):
            out.tuple.SetInParent()
            for i, item in enumerate(v):
                self._value(item, out.tuple.items.add(), payload, f"{path}[{i}]", depth + 1)
        elif isinstance(v, dict):
            out.dict.SetInParent()
            for k in v:
                if _simple_type(k) not in ("bool", "int", "float", "str", "Tensor"):
                    raise EncodeError(f"{path}: a dict key of type {type(k).__name__} (keys are str, int, float, "
                                      "bool or tensors)")
            out.dict.key_type = _common_type(v.keys())
            out.dict.value_type = _common_type(v.values())
            for k, item in v.items():
                self._value(k, out.dict.keys.add(), payload, f"{path} key {k!r}", depth + 1)
                self._value(item, out.dict.values.add(), payload, f"{path}[{k!r}]", depth + 1)
        else:
            raise EncodeError(f"{path}: cannot send a value of type {type(v).__module__}.{type(v).__qualname__} "
                              "(None, bool, int, float, complex, str, bytes, list, tuple, dict, numpy arrays and "
                              "torch tensors)")

    def _tensor(self, v, payload, path):
        if id(v) in self._seen:
            return self._seen[id(v)]
        if isinstance(v, np.ndarray):
            arr = v if v.flags.c_contiguous else np.ascontiguousarray(v)  # (which makes a 0-d array 1-d)
            if arr.dtype.byteorder == ">":
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            code = _CODES.get(arr.dtype.newbyteorder("="))
            if code is None:
                raise EncodeError(f"{path}: cannot send a numpy array of dtype {v.dtype}")
        else:
            if v.device.type != "cpu":
                raise EncodeError(f"{path}: cannot send a tensor on {v.device}: only CPU tensors")
            if v.layout != torch.strided:
                raise EncodeError(f"{path}: cannot send a sparse or non-strided tensor")
            code = _TORCH_CODES.get(v.dtype)
            if code is None:
                raise EncodeError(f"{path}: cannot send a tensor of dtype {v.dtype}")
            t = v.detach().resolve_conj().resolve_neg().contiguous()  # a lazy conj()/neg view: its values
            if code in _TORCH_CARRIER:
                t = t.view(_TORCH_CARRIER[code])
            arr = t.numpy()
        if arr.ndim > MAX_DIMS:
            raise EncodeError(f"{path}: a tensor of {arr.ndim} dimensions (at most {MAX_DIMS})")
        meta = payload.tensors.add()
        meta.dtype = code
        meta.sizes.extend(arr.shape)
        meta.nbytes = arr.nbytes
        meta.offset = self._offset
        if arr.nbytes:
            self._buffers.append((arr.reshape(-1).view(np.uint8), arr.nbytes))
        self._offset = align_up(self._offset + arr.nbytes)
        index = len(payload.tensors) - 1
        self._seen[id(v)] = index
        self._keep.append(v)
        return index


class Frame:
    """A received frame: its header parsed into `header`, its tensors decoded on demand."""

    def __init__(self, data, header):
        if len(data) < 4:
            raise ValueError("malformed message: shorter than its frame header")
        (n,) = struct.unpack_from("<I", data, 0)
        if n > len(data) - 4:
            raise ValueError(f"malformed message: header length {n} exceeds the message ({len(data)} bytes)")
        header.ParseFromString(data[4:4 + n])
        self._data = data
        self._payload_start = min(align_up(4 + n), len(data))

    def decode(self, payload, as_torch=False):
        tensors = [None] * len(payload.tensors)
        return [self._value(v, payload, tensors, as_torch, 0) for v in payload.values]

    def _value(self, v, payload, tensors, as_torch, depth):
        if depth > MAX_NESTING:
            raise ValueError("malformed message: value nested too deeply")
        kind = v.WhichOneof("kind")
        if kind == "none":
            return None
        if kind in ("b", "i", "d"):
            return getattr(v, kind)
        if kind == "c":
            return complex(v.c.re, v.c.im)
        if kind == "s":
            try:
                return v.s.decode("utf-8")
            except UnicodeDecodeError:  # a C++ std::string holds any bytes
                return v.s
        if kind == "tensor":
            if v.tensor >= len(tensors):
                raise ValueError(f"malformed message: tensor index {v.tensor} out of range")
            if tensors[v.tensor] is None:
                tensors[v.tensor] = self._tensor(payload.tensors[v.tensor], as_torch)
            return tensors[v.tensor]
        if kind in ("list", "tuple"):
            items = [self._value(item, payload, tensors, as_torch, depth + 1) for item in getattr(v, kind).items]
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            d = v.dict
            if len(d.keys) != len(d.values):
                raise ValueError("malformed message: dict keys/values")
            out = {}
            for k, val in zip(d.keys, d.values):
                key = self._value(k, payload, tensors, as_torch, depth + 1)
                if isinstance(key, np.ndarray):
                    raise EncodeError("a dict keyed by tensors arrived: numpy arrays cannot be keys (use "
                                      "tensors='torch')")
                out[key] = self._value(val, payload, tensors, as_torch, depth + 1)
            return out
        if kind == "ext":
            raise EncodeError(f"a value of kind '{v.ext.kind}' arrived: a client outside the job cannot hold it")
        raise ValueError("malformed message: value of unknown kind")

    def _tensor(self, meta, as_torch):
        code = meta.dtype
        if code not in _DTYPES and code not in _CARRIER:
            raise ValueError(f"malformed message: unsupported dtype {code}")
        if len(meta.sizes) > MAX_DIMS or any(s < 0 for s in meta.sizes):
            raise ValueError("malformed message: invalid tensor size")
        carrier = _DTYPES.get(code, _CARRIER.get(code))
        numel = math.prod(meta.sizes)  # Python integers: a lying size cannot overflow into a plausible one
        if numel * carrier.itemsize != meta.nbytes:
            raise ValueError(f"malformed message: tensor claims {meta.nbytes} bytes for {numel} elements")
        if meta.by_reference:
            raise ValueError("malformed message: a tensor sent by reference to a client")
        if meta.offset + meta.nbytes > len(self._data) - self._payload_start:
            raise ValueError("malformed message: tensor bytes exceed the payload")
        if numel == 0:
            arr = np.empty(tuple(meta.sizes), dtype=carrier)
        else:  # one copy out of the received bytes: the array is the caller's, writable
            arr = np.frombuffer(self._data, dtype=carrier.newbyteorder("<"), count=numel,
                                offset=self._payload_start + meta.offset).reshape(tuple(meta.sizes)).copy()
        if as_torch and torch is not None:
            t = torch.from_numpy(arr)
            return t.view(_TORCH_DTYPES[code]) if code in _CARRIER else t
        if code in _CARRIER:
            raise EncodeError(f"a {_NAMES[code]} tensor arrived: numpy has no such dtype (use tensors='torch' "
                              "with PyTorch installed)")
        return arr
