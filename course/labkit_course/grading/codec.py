"""A safe codec for values crossing between the trusted grader and a student's kernel.

Nothing is unpickled: a message is JSON built from a closed set of node types (None, bool, int,
float, str, bytes, list, tuple, dict, OrderedDict, deque, set, frozenset, torch tensors, dtypes,
devices and generators, numpy arrays and generators, and the course's registered dataclasses such
as `Block`), so decoding
student data can only ever produce those. Shared references survive (two tensors viewing one
storage stay views of one storage; a `Block` in two lists is one object), and a reply can describe
the arguments' new contents so the caller's own objects are updated in place: graders check that
a function mutates (or leaves alone) what it was given.

Anything the sender cannot encode is an error on the trusted side (a grader bug) and, on the
student's side, a handle: an opaque reference the trusted side can only call or read attributes of
through the kernel (how a student's class instance is graded).
"""

import base64
import dataclasses
import importlib
import json
import math
import sys
from collections import Counter, OrderedDict, deque

import numpy as np
import torch

MAX_MESSAGE_BYTES = 512 * 2**20
MAX_DEPTH = 64  # nesting of lists, dicts, objects in one message
MAX_VIEW_BYTES = 64 * 2**20  # a tensor may view more bytes than its storage holds (stride 0) up to this
MAX_SAME_HASH = 16  # elements of one set or keys of one dict that share a hash (collisions make sets quadratic)
# Dataclasses that may cross: the course's own records (the engine parts' Request, for Lab 11's capstone;
# the records graders pass, which live apart from the graders so that a student's kernel can import them).
TRUSTED_DATACLASS_MODULES = ("labkit.cache.block_manager", "labkit_course.engine_parts",
                             "labkit_course.grading.records")


class CodecError(ValueError):
    """A message that breaks the codec's rules (too large, an unknown type, an out-of-bounds view)."""


class Handle:
    """Stands for an object that stays in the student's kernel (see `labkit_course.grading.remote`)."""

    def __init__(self, number: int, type_name: str):
        self._number, self._type_name = number, type_name


def identity(value):
    """What makes two values one object on the wire: storages are one when they share memory."""
    if isinstance(value, torch.UntypedStorage):
        return ("storage", str(value.device), value.data_ptr(), value.nbytes())
    return id(value)


def _type_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _registered(cls: type) -> bool:
    module = cls.__module__
    return dataclasses.is_dataclass(cls) and module in TRUSTED_DATACLASS_MODULES


def _resolve_type(key: str, may_import: bool) -> type:
    module_name, _, qualname = key.partition(":")
    if module_name not in TRUSTED_DATACLASS_MODULES:
        raise CodecError(f"type {key} may not cross the grading channel")
    module = sys.modules.get(module_name)
    if module is None and may_import:
        module = importlib.import_module(module_name)
    cls = getattr(module, qualname, None) if module is not None and "." not in qualname else None
    if not (isinstance(cls, type) and _registered(cls)):
        raise CodecError(f"type {key} is not a course dataclass")
    return cls


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CodecError(f"unknown dtype {name!r}")
    return dtype


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise CodecError(f"unknown device {name!r}") from error
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise CodecError(f"device {name!r} may not cross the grading channel")
    return device


def _storage_bytes(storage: torch.UntypedStorage) -> bytes:
    cpu = storage.cpu() if storage.device.type != "cpu" else storage
    return torch.empty(0, dtype=torch.uint8).set_(cpu).numpy().tobytes() if cpu.nbytes() else b""


def _extent_ok(offset: int, shape, stride, itemsize: int, nbytes: int) -> bool:
    if any(s < 0 for s in shape) or any(st < 0 for st in stride) or offset < 0 or len(shape) != len(stride):
        return False
    if 0 in shape:
        return offset * itemsize <= nbytes
    last = offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return (last + 1) * itemsize <= nbytes


class Encoder:
    """Turns values into JSON nodes; `known` maps objects already on the other side to their ids."""

    def __init__(self, handles=None, known: dict | None = None):
        self.handles = handles  # None: unencodable values are errors; else a callable object -> number
        self.ids: dict = dict(known or {})  # identity(obj) -> node id
        self.keep = []  # objects whose ids are in self.ids stay alive while encoding
        self.next_id = max(self.ids.values(), default=-1) + 1

    def _new_id(self, obj) -> int:
        number = self.next_id
        self.next_id += 1
        self.ids[identity(obj)] = number
        self.keep.append(obj)
        return number

    def encode(self, value):
        kind = type(value)
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
        if identity(value) in self.ids:
            return {"ref": self.ids[identity(value)]}
        return self.contents(value, self._new_id(value) if self._has_identity(value) else None)

    @staticmethod
    def _has_identity(value) -> bool:
        return type(value) not in (bytes, tuple, frozenset, torch.dtype, torch.device)

    def contents(self, value, number: int | None):
        """The node for `value` itself (not a reference to it), tagged with `number`."""
        kind = type(value)
        node: dict = {"id": number} if number is not None else {}
        if kind is bytes:
            node.update(t="bytes", b=base64.b64encode(value).decode())
        elif kind in (list, tuple, set, frozenset):
            node.update(t=kind.__name__, items=[self.encode(v) for v in value])
        elif kind is deque:
            node.update(t="deque", items=[self.encode(v) for v in value], maxlen=value.maxlen)
        elif kind in (dict, OrderedDict):
            node.update(t="dict" if kind is dict else "odict",
                        items=[[self.encode(k), self.encode(v)] for k, v in value.items()])
        elif isinstance(value, torch.Tensor):
            node.update(self._tensor(value))
        elif kind is torch.dtype:
            node.update(t="dtype", v=str(value).removeprefix("torch."))
        elif kind is torch.device:
            node.update(t="device", v=str(value))
        elif kind is torch.Generator:
            node.update(t="generator", device=str(value.device),
                        state=base64.b64encode(_storage_bytes(value.get_state().untyped_storage())).decode())
        elif kind is np.ndarray and not value.dtype.hasobject:
            node.update(t="ndarray", dtype=value.dtype.str, shape=list(value.shape),
                        b=base64.b64encode(np.ascontiguousarray(value).tobytes()).decode())
        elif kind is np.random.Generator:
            node.update(t="np_generator", state=json.dumps(value.bit_generator.state))
        elif isinstance(value, torch.UntypedStorage):
            node.update(t="storage", device=str(value.device), b=base64.b64encode(_storage_bytes(value)).decode())
        elif dataclasses.is_dataclass(kind) and _registered(kind):
            node.update(t="obj", type=_type_key(kind),
                        fields={f.name: self.encode(getattr(value, f.name)) for f in dataclasses.fields(value)})
        elif isinstance(value, Handle):
            node.update(t="handle", h=value._number)
        elif self.handles is not None:
            node.update(t="handle", h=self.handles(value), type=type(value).__name__)
        else:
            raise CodecError(f"a {kind.__name__} cannot be sent to the student's kernel")
        return node

    def _tensor(self, tensor: torch.Tensor) -> dict:
        tensor = tensor.detach()
        return {"t": "tensor", "storage": self.encode(tensor.untyped_storage()),
                "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                "stride": list(tensor.stride()), "offset": tensor.storage_offset()}


class Decoder:
    """Rebuilds values from JSON nodes; `known` maps ids to objects already here (updated in place)."""

    def __init__(self, handle=None, known: dict[int, object] | None = None, may_import: bool = False):
        self.handle = handle  # callable (number, type name) -> object that stands for a handle
        self.objects: dict[int, object] = dict(known or {})
        self.may_import = may_import
        self.depth = 0

    def decode(self, node):
        if node is None or type(node) in (bool, int, str, float):
            return node
        if type(node) is not dict:
            raise CodecError(f"malformed node of type {type(node).__name__}")
        if "ref" in node:
            try:
                return self.objects[node["ref"]]
            except (KeyError, TypeError):
                raise CodecError(f"reference to unknown object {node['ref']!r}") from None
        if self.depth >= MAX_DEPTH:
            raise CodecError(f"values nested deeper than {MAX_DEPTH} levels")
        self.depth += 1
        try:
            return self.build(node)
        finally:
            self.depth -= 1

    def _remember(self, node, obj):
        if node.get("id") is not None:
            self.objects[node["id"]] = obj
        return obj

    def build(self, node: dict):
        t = node.get("t")
        if t == "float":
            if node["v"] not in ("nan", "inf", "-inf"):
                raise CodecError(f"bad float {node['v']!r}")
            return float(node["v"])
        if t == "bytes":
            return base64.b64decode(node["b"], validate=True)
        if t in ("tuple", "frozenset"):
            items = [self.decode(v) for v in node["items"]]
            return tuple(items) if t == "tuple" else frozenset(_spread(items))
        if t == "dtype":
            return _dtype(node["v"])
        if t == "device":
            return _device(node["v"])
        if t == "handle":
            if self.handle is None:
                raise CodecError("handles only come from the student's kernel")
            type_name = node.get("type", "object")
            return self._remember(node, self.handle(node["h"], type_name[:80] if type(type_name) is str else "object"))
        empty = {"list": list, "set": set, "dict": dict, "odict": OrderedDict}.get(t)
        if empty is not None:
            obj = self._remember(node, empty())
        elif t == "deque":
            obj = self._remember(node, deque(maxlen=node.get("maxlen")))
        elif t == "tensor":
            obj = self._remember(node, self._tensor(node))
            return obj
        elif t == "storage":
            obj = self._remember(node, self._storage(node))
            return obj
        elif t == "generator":
            obj = self._remember(node, torch.Generator(_device(node["device"])))
        elif t == "ndarray":
            dtype = np.dtype(node["dtype"])
            if dtype.hasobject:
                raise CodecError("numpy arrays of Python objects are not carried")
            shape = node["shape"]
            if not (type(shape) is list and len(shape) <= 32 and all(type(n) is int and n >= 0 for n in shape)):
                raise CodecError("a numpy array's shape must be a few non-negative integers")
            if math.prod(shape) * dtype.itemsize != len(node["b"]) // 4 * 3 - node["b"][-2:].count("="):
                raise CodecError("a numpy array's bytes do not match its shape and dtype")
            obj = self._remember(node, np.empty(shape, dtype=dtype))
        elif t == "np_generator":
            obj = self._remember(node, np.random.Generator(_numpy_bit_generator(node["state"])))
        elif t == "obj":
            cls = _resolve_type(node["type"], self.may_import)
            obj = self._remember(node, object.__new__(cls))
        else:
            raise CodecError(f"unknown node type {t!r}")
        self.fill(obj, node)
        return obj

    def fill(self, obj, node: dict) -> None:
        """Make `obj` hold what `node` describes, in place (new objects and write-backs alike)."""
        t = node.get("t")
        if isinstance(obj, list) and t == "list":
            obj[:] = [self.decode(v) for v in node["items"]]
        elif isinstance(obj, deque) and t == "deque":
            obj.clear()
            obj.extend(self.decode(v) for v in node["items"])
        elif isinstance(obj, set) and t == "set":
            items = _spread([self.decode(v) for v in node["items"]])
            obj.clear()
            obj.update(items)
        elif isinstance(obj, dict) and t in ("dict", "odict"):
            items = [(self.decode(k), self.decode(v)) for k, v in node["items"]]
            _spread([k for k, _ in items])
            obj.clear()
            obj.update(items)
        elif isinstance(obj, torch.Generator) and t == "generator":
            state = base64.b64decode(node["state"], validate=True)
            try:
                obj.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8) if state else
                              torch.empty(0, dtype=torch.uint8))
            except RuntimeError as error:
                raise CodecError(f"invalid generator state: {error}") from None
        elif isinstance(obj, np.ndarray) and t == "ndarray":
            data = base64.b64decode(node["b"], validate=True)
            if len(data) != obj.nbytes or np.dtype(node["dtype"]) != obj.dtype:
                raise CodecError("a numpy array came back with another size or dtype")
            obj[...] = np.frombuffer(data, dtype=obj.dtype).reshape(obj.shape)
        elif isinstance(obj, np.random.Generator) and t == "np_generator":
            obj.bit_generator.state = _numpy_bit_generator(node["state"]).state
        elif isinstance(obj, torch.UntypedStorage) and t == "storage":
            data = base64.b64decode(node["b"], validate=True)
            if len(data) != obj.nbytes():
                obj.resize_(len(data))
            if data:
                obj.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage())
        elif isinstance(obj, torch.Tensor) and t == "tensor":
            fresh = self._tensor(node)
            if fresh.untyped_storage().data_ptr() != obj.untyped_storage().data_ptr() or (
                    fresh.shape, fresh.stride(), fresh.storage_offset()) != (obj.shape, obj.stride(),
                                                                             obj.storage_offset()):
                with torch.no_grad():
                    obj.set_(fresh.untyped_storage(), fresh.storage_offset(), fresh.shape, fresh.stride())
        elif t == "obj" and dataclasses.is_dataclass(obj) and _type_key(type(obj)) == node["type"]:
            names = {f.name for f in dataclasses.fields(obj)}
            fields = node["fields"]
            if set(fields) != names:
                raise CodecError(f"{node['type']} needs the fields {sorted(names)}")
            for name, value in fields.items():
                object.__setattr__(obj, name, self.decode(value))
        else:
            raise CodecError(f"cannot update a {type(obj).__name__} from a {t!r} node")

    def _storage(self, node: dict) -> torch.UntypedStorage:
        data = base64.b64decode(node["b"], validate=True)
        storage = torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage() if data \
            else torch.UntypedStorage(0)
        device = _device(node["device"])
        return storage if device.type == "cpu" else storage.to(device=device)

    def _tensor(self, node: dict) -> torch.Tensor:
        storage = self.decode(node["storage"])
        if not isinstance(storage, torch.UntypedStorage):
            raise CodecError("a tensor must view a storage")
        dtype = _dtype(node["dtype"])
        shape, stride, offset = node["shape"], node["stride"], node["offset"]
        if not (type(shape) is list and type(stride) is list and len(shape) <= 16
                and all(type(x) is int and 0 <= x < 2**48 for x in [*shape, *stride, offset])):
            raise CodecError("a tensor's shape, strides and offset must be a few non-negative integers")
        if not _extent_ok(offset, shape, stride, dtype.itemsize, storage.nbytes()):
            raise CodecError("a tensor's shape and strides reach outside its storage")
        viewed = math.prod(shape) * dtype.itemsize
        if viewed > max(storage.nbytes(), MAX_VIEW_BYTES):
            raise CodecError(f"a tensor views {viewed} bytes of a {storage.nbytes()}-byte storage (repeated by "
                             "zero strides): send the values themselves")
        if offset * dtype.itemsize > storage.nbytes():
            raise CodecError("a tensor's offset is outside its storage")
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


def _spread(keys: list) -> list:
    """`keys` if they can go into one set or dict in linear time: not too many share a hash."""
    try:
        counts = Counter(hash(k) for k in keys)
    except TypeError as error:
        raise CodecError(f"unhashable set element or dict key: {error}") from None
    if counts and max(counts.values()) > MAX_SAME_HASH:
        raise CodecError(f"more than {MAX_SAME_HASH} elements of a set or keys of a dict share one hash")
    return keys


def dumps(node) -> str:
    text = json.dumps(node, separators=(",", ":"), allow_nan=False)
    if len(text) > MAX_MESSAGE_BYTES:
        raise CodecError(f"message of {len(text)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    return text


def loads(text: str):
    if len(text) > MAX_MESSAGE_BYTES:
        raise CodecError(f"message of {len(text)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:
        raise CodecError(f"malformed message: {error}") from None


def _no_constant(name: str):
    raise CodecError(f"bare {name} is not allowed (floats travel as nodes)")


_NUMPY_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def _numpy_bit_generator(text: str):
    """A numpy bit generator in the state `text` describes (one of numpy's own kinds only)."""
    try:
        state = json.loads(text)
        name = state["bit_generator"]
        if name not in _NUMPY_BIT_GENERATORS:
            raise CodecError(f"unknown numpy bit generator {name!r}")
        bit_generator = getattr(np.random, name)()
        bit_generator.state = state
    except (TypeError, ValueError, KeyError) as error:
        raise CodecError(f"invalid numpy generator state: {error}") from None
    return bit_generator
