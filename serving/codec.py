"""The tensor codec both transports share (serving/grpc_api/converters.py and
serving/rest_api/converters.py): the checks every inference request gets, V2 raw bytes <-> arrays, and
outputs laid out for the wire.

A request is checked once, before anything is queued: input names present and unique, a V2 datatype,
a shape of non-negative integer sizes, and all inputs together within the element cap (``Budget``).
Anything else raises ``InvalidInput`` naming the input, what is wrong and what was expected.

Raw bytes (V2 spec; gRPC ``raw_input_contents``, REST's binary tensor data extension): little-endian and
row-major, one buffer per tensor; a BYTES element is a 4-byte little-endian length then its bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from serving.errors import InvalidInput
from serving.types import DATATYPES, RequestedOutput, Tensor

Array = npt.NDArray[Any]

_LENGTH = struct.Struct("<I")

DEFAULT_MAX_ELEMENTS = 64 * 2**20
# numpy before 2.0 refuses more; no model we serve comes near it.
MAX_DIMS = 32


class Budget:
    """The request's element cap, spent input by input, so many small inputs cannot add up past it."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0

    def charge(self, name: str, dims: Sequence[Any]) -> tuple[tuple[int, ...], int]:
        """Validate a shape and charge its elements; returns the shape and its element count."""
        if len(dims) > MAX_DIMS:
            raise InvalidInput(f"input {name!r}: shape has {len(dims)} dimensions; expected at most {MAX_DIMS}")
        for axis, dim in enumerate(dims):
            if not isinstance(dim, int | np.integer) or isinstance(dim, bool):
                raise InvalidInput(f"input {name!r}: dimension {axis} is {dim!r}; expected an integer size")
            if dim < 0:
                raise InvalidInput(
                    f"input {name!r}: dimension {axis} of shape {list(dims)} is {dim}; expected a size >= 0 "
                    "(send the actual size, not -1)"
                )
            if dim > self.cap:
                raise InvalidInput(
                    f"input {name!r}: dimension {axis} of shape {list(dims)} is {dim}, over the cap of {self.cap} "
                    "elements per request; expected a smaller tensor (split the batch across requests)"
                )
        shape = tuple(int(d) for d in dims)
        count = math.prod(shape)
        self.used += count
        if self.used > self.cap:
            raise InvalidInput(
                f"input {name!r}: shape {list(shape)} has {count} elements, which brings the request to "
                f"{self.used}; expected at most {self.cap} in all (split the batch across requests)"
            )
        return shape, count


def input_name(name: Any, index: int, seen: dict[str, int]) -> str:
    """The name of input ``index``, refused when missing or already in ``seen`` (name -> index)."""
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"input #{index} has no name ({name!r}); expected the name of a model input")
    if name in seen:
        raise InvalidInput(f"input {name!r} appears twice (#{seen[name]} and #{index}); expected each input once")
    seen[name] = index
    return name


def input_datatype(name: str, datatype: Any) -> str:
    """The datatype of input ``name``, refused unless it is a V2 datatype."""
    if datatype not in DATATYPES:
        raise InvalidInput(
            f"input {name!r}: datatype {datatype!r} is not a V2 datatype; expected one of {', '.join(DATATYPES)}"
        )
    return str(datatype)


def requested_output(name: Any, index: int, seen: set[str], parameters: dict[str, Any]) -> RequestedOutput:
    """Requested output ``index``, refused when unnamed or already in ``seen``."""
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"requested output #{index} has no name ({name!r}); expected the name of a model output")
    if name in seen:
        raise InvalidInput(f"output {name!r} is requested twice; expected each output once")
    seen.add(name)
    return RequestedOutput(name=name, parameters=parameters)


def object_array(items: Sequence[bytes]) -> Array:
    """A one-dimensional object array of BYTES elements."""
    # Filled element by element: np.array() would try to read equal-length bytes as a 2-D array.
    array = np.empty(len(items), dtype=np.object_)
    for i, item in enumerate(items):
        array[i] = item
    return array


def flat_output(tensor: Tensor) -> Array:
    """Row-major, one-dimensional, in the wire dtype; a size that contradicts the shape is our bug."""
    if tensor.datatype not in DATATYPES:
        raise ValueError(f"output {tensor.name!r}: datatype {tensor.datatype!r} is not a V2 datatype")
    data = np.asarray(tensor.data)
    if data.size != math.prod(tensor.shape):
        raise ValueError(f"output {tensor.name!r}: {data.size} elements for shape {list(tensor.shape)}")
    if tensor.datatype == "BYTES":
        return data.reshape(-1)
    return np.ascontiguousarray(data, dtype=DATATYPES[tensor.datatype].newbyteorder("<")).reshape(-1)


def decode_raw(name: str, datatype: str, shape: tuple[int, ...], count: int, buffer: bytes) -> Array:
    """One tensor from its raw little-endian bytes (BYTES: 4-byte length + bytes per element), checked."""
    if datatype == "BYTES":
        return _bytes_from_raw(name, shape, count, buffer)
    dtype = DATATYPES[datatype]
    expected = count * dtype.itemsize
    if len(buffer) != expected:
        raise InvalidInput(
            f"input {name!r}: raw contents are {len(buffer)} bytes; expected {expected} "
            f"({count} {datatype} elements of {dtype.itemsize} bytes for shape {list(shape)})"
        )
    if datatype == "BOOL":
        # Any non-zero byte is true; a numpy bool holding 2 would compare unequal to True.
        return np.frombuffer(buffer, dtype=np.uint8).astype(np.bool_).reshape(shape)
    # Zero-copy and read-only: the array shares the request's bytes.
    return np.frombuffer(buffer, dtype=dtype.newbyteorder("<")).reshape(shape)


def _bytes_from_raw(name: str, shape: tuple[int, ...], count: int, buffer: bytes) -> Array:
    items, offset, size = [], 0, len(buffer)
    # Checked from the shape before walking: every element costs a Python object, and a count the buffer
    # cannot hold (4 length bytes each at least) would build most of them before failing at the end.
    if count * _LENGTH.size > size:
        raise InvalidInput(
            f"input {name!r}: raw BYTES contents are {size} bytes, too few for the {count} elements of shape "
            f"{list(shape)}; expected each element as a 4-byte little-endian length followed by its bytes"
        )
    for index in range(count):
        if offset + _LENGTH.size > size:
            raise InvalidInput(
                f"input {name!r}: raw BYTES contents end after {index} of {count} elements (shape {list(shape)}); "
                "expected each element as a 4-byte little-endian length followed by its bytes"
            )
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += _LENGTH.size
        if offset + length > size:
            raise InvalidInput(
                f"input {name!r}: raw BYTES element {index} declares {length} bytes but {size - offset} remain; "
                "expected each element as a 4-byte little-endian length followed by its bytes"
            )
        items.append(buffer[offset : offset + length])
        offset += length
    if offset != size:
        raise InvalidInput(
            f"input {name!r}: {size - offset} bytes left over after the {count} BYTES elements of shape "
            f"{list(shape)}; expected exactly {count} length-prefixed elements"
        )
    return object_array(items).reshape(shape)


def as_bytes(item: Any) -> bytes:
    """A BYTES element as bytes (a str is sent as UTF-8)."""
    return item.encode() if isinstance(item, str) else bytes(item)


def encode_raw(datatype: str, flat: Array) -> bytes:
    """The raw little-endian bytes of a flat tensor (BYTES: 4-byte length + bytes per element)."""
    if datatype != "BYTES":
        return flat.tobytes()
    parts: list[bytes] = []
    for item in flat:
        value = as_bytes(item)
        parts += (_LENGTH.pack(len(value)), value)
    return b"".join(parts)
