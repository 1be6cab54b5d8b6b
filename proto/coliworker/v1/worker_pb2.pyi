from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]

class Method(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METHOD_UNSPECIFIED: _ClassVar[Method]
    METHOD_INFO: _ClassVar[Method]
    METHOD_LOOKUP: _ClassVar[Method]
    METHOD_UPLOAD: _ClassVar[Method]
    METHOD_UPDATE: _ClassVar[Method]
    METHOD_FREE: _ClassVar[Method]
    METHOD_STATS: _ClassVar[Method]
    METHOD_MATMUL: _ClassVar[Method]
    METHOD_EXPERT_MLP: _ClassVar[Method]
    METHOD_EXPERT_GROUP: _ClassVar[Method]
    METHOD_EXPERT_GROUP_ROUTED: _ClassVar[Method]
    METHOD_EXPERT_GROUP_ISSUE: _ClassVar[Method]
    METHOD_EXPERT_GROUP_TAKE: _ClassVar[Method]
    METHOD_ATTENTION: _ClassVar[Method]
    METHOD_ATTENTION_RAGGED: _ClassVar[Method]
    METHOD_FREE_SEQUENCE: _ClassVar[Method]
    METHOD_SESSION: _ClassVar[Method]
    METHOD_DATA_TICKET: _ClassVar[Method]
    METHOD_TENSOR_USAGE: _ClassVar[Method]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_UINT8: DType
DTYPE_INT32: DType
METHOD_UNSPECIFIED: Method
METHOD_INFO: Method
METHOD_LOOKUP: Method
METHOD_UPLOAD: Method
METHOD_UPDATE: Method
METHOD_FREE: Method
METHOD_STATS: Method
METHOD_MATMUL: Method
METHOD_EXPERT_MLP: Method
METHOD_EXPERT_GROUP: Method
METHOD_EXPERT_GROUP_ROUTED: Method
METHOD_EXPERT_GROUP_ISSUE: Method
METHOD_EXPERT_GROUP_TAKE: Method
METHOD_ATTENTION: Method
METHOD_ATTENTION_RAGGED: Method
METHOD_FREE_SEQUENCE: Method
METHOD_SESSION: Method
METHOD_DATA_TICKET: Method
METHOD_TENSOR_USAGE: Method

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shm", "staged")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shm: Slice
    staged: Slice
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[Slice, _Mapping]] = ..., staged: _Optional[_Union[Slice, _Mapping]] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("id", "name", "total_memory_bytes", "free_memory_bytes", "memory_limit_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    total_memory_bytes: int
    free_memory_bytes: int
    memory_limit_bytes: int
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., total_memory_bytes: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_experts", "max_message_bytes", "upload_chunk_bytes", "max_pending_tickets", "max_sequences_per_call", "max_kv_rows", "max_frame_bytes")
    MAX_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_TICKETS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_experts: int
    max_message_bytes: int
    upload_chunk_bytes: int
    max_pending_tickets: int
    max_sequences_per_call: int
    max_kv_rows: int
    max_frame_bytes: int
    def __init__(self, max_experts: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., upload_chunk_bytes: _Optional[int] = ..., max_pending_tickets: _Optional[int] = ..., max_sequences_per_call: _Optional[int] = ..., max_kv_rows: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "backend", "devices", "limits", "instance_id", "data_port", "data_unix_socket", "data_tls")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_TLS_FIELD_NUMBER: _ClassVar[int]
    version: str
    backend: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    limits: Limits
    instance_id: str
    data_port: int
    data_unix_socket: str
    data_tls: bool
    def __init__(self, version: _Optional[str] = ..., backend: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., instance_id: _Optional[str] = ..., data_port: _Optional[int] = ..., data_unix_socket: _Optional[str] = ..., data_tls: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("fmt", "in_features", "out_features", "group_size", "device")
    FMT_FIELD_NUMBER: _ClassVar[int]
    IN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    OUT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    fmt: int
    in_features: int
    out_features: int
    group_size: int
    device: int
    def __init__(self, fmt: _Optional[int] = ..., in_features: _Optional[int] = ..., out_features: _Optional[int] = ..., group_size: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("handle", "spec", "content_hash", "nbytes", "references")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    spec: TensorSpec
    content_hash: bytes
    nbytes: int
    references: int
    def __init__(self, handle: _Optional[int] = ..., spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., content_hash: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., references: _Optional[int] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("spec", "content_hash", "weight_bytes", "scale_bytes", "handle")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCALE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    spec: TensorSpec
    content_hash: bytes
    weight_bytes: int
    scale_bytes: int
    handle: int
    def __init__(self, spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., content_hash: _Optional[bytes] = ..., weight_bytes: _Optional[int] = ..., scale_bytes: _Optional[int] = ..., handle: _Optional[int] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadResponse(_message.Message):
    __slots__ = ("tensor", "deduplicated", "backend_ns")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NS_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorInfo
    deduplicated: bool
    backend_ns: int
    def __init__(self, tensor: _Optional[_Union[TensorInfo, _Mapping]] = ..., deduplicated: _Optional[bool] = ..., backend_ns: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("content_hash", "device", "acquire")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    content_hash: bytes
    device: int
    acquire: bool
    def __init__(self, content_hash: _Optional[bytes] = ..., device: _Optional[int] = ..., acquire: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found", "tensor")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    found: bool
    tensor: TensorInfo
    def __init__(self, found: _Optional[bool] = ..., tensor: _Optional[_Union[TensorInfo, _Mapping]] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("tensor", "backend_ns")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NS_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorInfo
    backend_ns: int
    def __init__(self, tensor: _Optional[_Union[TensorInfo, _Mapping]] = ..., backend_ns: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    def __init__(self, handle: _Optional[int] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("released_bytes", "references")
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    released_bytes: int
    references: int
    def __init__(self, released_bytes: _Optional[int] = ..., references: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupStats(_message.Message):
    __slots__ = ("calls", "experts", "rows", "h2d_ns", "kernel_ns", "d2h_ns")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    H2D_NS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_NS_FIELD_NUMBER: _ClassVar[int]
    D2H_NS_FIELD_NUMBER: _ClassVar[int]
    calls: int
    experts: int
    rows: int
    h2d_ns: int
    kernel_ns: int
    d2h_ns: int
    def __init__(self, calls: _Optional[int] = ..., experts: _Optional[int] = ..., rows: _Optional[int] = ..., h2d_ns: _Optional[int] = ..., kernel_ns: _Optional[int] = ..., d2h_ns: _Optional[int] = ...) -> None: ...

class DeviceStats(_message.Message):
    __slots__ = ("device", "tensors", "tensor_bytes", "handles", "kv_sequences", "kv_bytes", "group")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    KV_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    device: int
    tensors: int
    tensor_bytes: int
    handles: int
    kv_sequences: int
    kv_bytes: int
    group: GroupStats
    def __init__(self, device: _Optional[int] = ..., tensors: _Optional[int] = ..., tensor_bytes: _Optional[int] = ..., handles: _Optional[int] = ..., kv_sequences: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., group: _Optional[_Union[GroupStats, _Mapping]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceStats]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceStats, _Mapping]]] = ...) -> None: ...

class MatmulRequest(_message.Message):
    __slots__ = ("handle", "x", "output_dtype")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    x: Array
    output_dtype: DType
    def __init__(self, handle: _Optional[int] = ..., x: _Optional[_Union[Array, _Mapping]] = ..., output_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class MatmulResponse(_message.Message):
    __slots__ = ("y", "backend_ns")
    Y_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NS_FIELD_NUMBER: _ClassVar[int]
    y: Array
    backend_ns: int
    def __init__(self, y: _Optional[_Union[Array, _Mapping]] = ..., backend_ns: _Optional[int] = ...) -> None: ...

class ExpertMlpRequest(_message.Message):
    __slots__ = ("gate", "up", "down", "x", "output_dtype")
    GATE_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    DOWN_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    gate: int
    up: int
    down: int
    x: Array
    output_dtype: DType
    def __init__(self, gate: _Optional[int] = ..., up: _Optional[int] = ..., down: _Optional[int] = ..., x: _Optional[_Union[Array, _Mapping]] = ..., output_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class ExpertMlpResponse(_message.Message):
    __slots__ = ("y", "backend_ns")
    Y_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NS_FIELD_NUMBER: _ClassVar[int]
    y: Array
    backend_ns: int
    def __init__(self, y: _Optional[_Union[Array, _Mapping]] = ..., backend_ns: _Optional[int] = ...) -> None: ...

class Expert(_message.Message):
    __slots__ = ("gate", "up", "down")
    GATE_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    DOWN_FIELD_NUMBER: _ClassVar[int]
    gate: int
    up: int
    down: int
    def __init__(self, gate: _Optional[int] = ..., up: _Optional[int] = ..., down: _Optional[int] = ...) -> None: ...

class ExpertGroupRequest(_message.Message):
    __slots__ = ("experts", "rows", "x", "output_dtype")
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    experts: _containers.RepeatedCompositeFieldContainer[Expert]
    rows: _containers.RepeatedScalarFieldContainer[int]
    x: Array
    output_dtype: DType
    def __init__(self, experts: _Optional[_Iterable[_Union[Expert, _Mapping]]] = ..., rows: _Optional[_Iterable[int]] = ..., x: _Optional[_Union[Array, _Mapping]] = ..., output_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class ExpertGroupResponse(_message.Message):
    __slots__ = ("y", "backend_ns", "h2d_ns", "kernel_ns", "d2h_ns")
    Y_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NS_FIELD_NUMBER: _ClassVar[int]
    H2D_NS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_NS_FIELD_NUMBER: _ClassVar[int]
    D2H_NS_FIELD_NUMBER: _ClassVar[int]
    y: Array
    backend_ns: int
    h2d_ns: int
    kernel_ns: int
    d2h_ns: int
    def __init__(self, y: _Optional[_Union[Array, _Mapping]] = ..., backend_ns: _Optional[int] = ..., h2d_ns: _Optional[int] = ..., kernel_ns: _Optional[int] = ..., d2h_ns: _Optional[int] = ...) -> None: ...

class ExpertGroupRoutedRequest(_message.Message):
    __slots__ = ("experts", "x", "routes", "weights", "output_dtype")
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    experts: _containers.RepeatedCompositeFieldContainer[Expert]
    x: Array
    routes: Array
    weights: Array
    output_dtype: DType
    def __init__(self, experts: _Optional[_Iterable[_Union[Expert, _Mapping]]] = ..., x: _Optional[_Union[Array, _Mapping]] = ..., routes: _Optional[_Union[Array, _Mapping]] = ..., weights: _Optional[_Union[Array, _Mapping]] = ..., output_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class ExpertGroupTicket(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    def __init__(self, ticket: _Optional[int] = ...) -> None: ...

class ExpertGroupTakeRequest(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    def __init__(self, ticket: _Optional[int] = ...) -> None: ...

class AttentionRequest(_message.Message):
    __slots__ = ("kv_b", "o_proj", "q", "latent", "rope", "q_dim", "rope_dim", "v_dim", "scale", "output_dtype")
    KV_B_FIELD_NUMBER: _ClassVar[int]
    O_PROJ_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    LATENT_FIELD_NUMBER: _ClassVar[int]
    ROPE_FIELD_NUMBER: _ClassVar[int]
    Q_DIM_FIELD_NUMBER: _ClassVar[int]
    ROPE_DIM_FIELD_NUMBER: _ClassVar[int]
    V_DIM_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    kv_b: int
    o_proj: int
    q: Array
    latent: Array
    rope: Array
    q_dim: int
    rope_dim: int
    v_dim: int
    scale: float
    output_dtype: DType
    def __init__(self, kv_b: _Optional[int] = ..., o_proj: _Optional[int] = ..., q: _Optional[_Union[Array, _Mapping]] = ..., latent: _Optional[_Union[Array, _Mapping]] = ..., rope: _Optional[_Union[Array, _Mapping]] = ..., q_dim: _Optional[int] = ..., rope_dim: _Optional[int] = ..., v_dim: _Optional[int] = ..., scale: _Optional[float] = ..., output_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class AttentionResponse(_message.Message):
    __slots__ = ("out", "backend_ns")
    OUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NS_FIELD_NUMBER: _ClassVar[int]
    out: Array
    backend_ns: int
    def __init__(self, out: _Optional[_Union[Array, _Mapping]] = ..., backend_ns: _Optional[int] = ...) -> None: ...

class SequenceRows(_message.Message):
    __slots__ = ("sequence_id", "start", "latent", "rope")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LATENT_FIELD_NUMBER: _ClassVar[int]
    ROPE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    start: int
    latent: Array
    rope: Array
    def __init__(self, sequence_id: _Optional[int] = ..., start: _Optional[int] = ..., latent: _Optional[_Union[Array, _Mapping]] = ..., rope: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class AttentionRaggedRequest(_message.Message):
    __slots__ = ("kv_b", "o_proj", "q", "sequences", "q_dim", "rope_dim", "v_dim", "scale", "output_dtype")
    KV_B_FIELD_NUMBER: _ClassVar[int]
    O_PROJ_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    Q_DIM_FIELD_NUMBER: _ClassVar[int]
    ROPE_DIM_FIELD_NUMBER: _ClassVar[int]
    V_DIM_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    kv_b: int
    o_proj: int
    q: Array
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceRows]
    q_dim: int
    rope_dim: int
    v_dim: int
    scale: float
    output_dtype: DType
    def __init__(self, kv_b: _Optional[int] = ..., o_proj: _Optional[int] = ..., q: _Optional[_Union[Array, _Mapping]] = ..., sequences: _Optional[_Iterable[_Union[SequenceRows, _Mapping]]] = ..., q_dim: _Optional[int] = ..., rope_dim: _Optional[int] = ..., v_dim: _Optional[int] = ..., scale: _Optional[float] = ..., output_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class AttentionRaggedResponse(_message.Message):
    __slots__ = ("out", "lengths", "backend_ns")
    OUT_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NS_FIELD_NUMBER: _ClassVar[int]
    out: Array
    lengths: _containers.RepeatedScalarFieldContainer[int]
    backend_ns: int
    def __init__(self, out: _Optional[_Union[Array, _Mapping]] = ..., lengths: _Optional[_Iterable[int]] = ..., backend_ns: _Optional[int] = ...) -> None: ...

class FreeSequenceRequest(_message.Message):
    __slots__ = ("sequence_id", "kv_b")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_B_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    kv_b: int
    def __init__(self, sequence_id: _Optional[int] = ..., kv_b: _Optional[int] = ...) -> None: ...

class FreeSequenceResponse(_message.Message):
    __slots__ = ("caches", "released_bytes")
    CACHES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    caches: int
    released_bytes: int
    def __init__(self, caches: _Optional[int] = ..., released_bytes: _Optional[int] = ...) -> None: ...

class ShmAttach(_message.Message):
    __slots__ = ("name", "size", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    nonce: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ShmTicket(_message.Message):
    __slots__ = ("ticket", "socket", "expires_ms")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    socket: str
    expires_ms: int
    def __init__(self, ticket: _Optional[bytes] = ..., socket: _Optional[str] = ..., expires_ms: _Optional[int] = ...) -> None: ...

class ShmAttached(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class DoorbellAttach(_message.Message):
    __slots__ = ("directory", "slots_offset", "slots", "slot_bytes", "worker_spin_us")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_SPIN_US_FIELD_NUMBER: _ClassVar[int]
    directory: str
    slots_offset: int
    slots: int
    slot_bytes: int
    worker_spin_us: int
    def __init__(self, directory: _Optional[str] = ..., slots_offset: _Optional[int] = ..., slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., worker_spin_us: _Optional[int] = ...) -> None: ...

class DoorbellAttached(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: int
    def __init__(self, slots: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("request_id", "matmul", "expert_group", "expert_group_routed", "attention", "attention_ragged", "expert_mlp", "attach_shm", "chunk", "attach_doorbell", "output_shm")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MATMUL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_GROUP_FIELD_NUMBER: _ClassVar[int]
    EXPERT_GROUP_ROUTED_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_RAGGED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MLP_FIELD_NUMBER: _ClassVar[int]
    ATTACH_SHM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ATTACH_DOORBELL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHM_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    matmul: MatmulRequest
    expert_group: ExpertGroupRequest
    expert_group_routed: ExpertGroupRoutedRequest
    attention: AttentionRequest
    attention_ragged: AttentionRaggedRequest
    expert_mlp: ExpertMlpRequest
    attach_shm: ShmAttach
    chunk: bytes
    attach_doorbell: DoorbellAttach
    output_shm: Slice
    def __init__(self, request_id: _Optional[int] = ..., matmul: _Optional[_Union[MatmulRequest, _Mapping]] = ..., expert_group: _Optional[_Union[ExpertGroupRequest, _Mapping]] = ..., expert_group_routed: _Optional[_Union[ExpertGroupRoutedRequest, _Mapping]] = ..., attention: _Optional[_Union[AttentionRequest, _Mapping]] = ..., attention_ragged: _Optional[_Union[AttentionRaggedRequest, _Mapping]] = ..., expert_mlp: _Optional[_Union[ExpertMlpRequest, _Mapping]] = ..., attach_shm: _Optional[_Union[ShmAttach, _Mapping]] = ..., chunk: _Optional[bytes] = ..., attach_doorbell: _Optional[_Union[DoorbellAttach, _Mapping]] = ..., output_shm: _Optional[_Union[Slice, _Mapping]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("request_id", "matmul", "expert_group", "expert_group_routed", "attention", "attention_ragged", "expert_mlp", "shm_attached", "chunk", "doorbell_attached", "shm_ticket", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MATMUL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_GROUP_FIELD_NUMBER: _ClassVar[int]
    EXPERT_GROUP_ROUTED_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_RAGGED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MLP_FIELD_NUMBER: _ClassVar[int]
    SHM_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    SHM_TICKET_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    matmul: MatmulResponse
    expert_group: ExpertGroupResponse
    expert_group_routed: ExpertGroupResponse
    attention: AttentionResponse
    attention_ragged: AttentionRaggedResponse
    expert_mlp: ExpertMlpResponse
    shm_attached: ShmAttached
    chunk: bytes
    doorbell_attached: DoorbellAttached
    shm_ticket: ShmTicket
    error: Status
    def __init__(self, request_id: _Optional[int] = ..., matmul: _Optional[_Union[MatmulResponse, _Mapping]] = ..., expert_group: _Optional[_Union[ExpertGroupResponse, _Mapping]] = ..., expert_group_routed: _Optional[_Union[ExpertGroupResponse, _Mapping]] = ..., attention: _Optional[_Union[AttentionResponse, _Mapping]] = ..., attention_ragged: _Optional[_Union[AttentionRaggedResponse, _Mapping]] = ..., expert_mlp: _Optional[_Union[ExpertMlpResponse, _Mapping]] = ..., shm_attached: _Optional[_Union[ShmAttached, _Mapping]] = ..., chunk: _Optional[bytes] = ..., doorbell_attached: _Optional[_Union[DoorbellAttached, _Mapping]] = ..., shm_ticket: _Optional[_Union[ShmTicket, _Mapping]] = ..., error: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("version", "token", "ticket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    version: int
    token: str
    ticket: bytes
    def __init__(self, version: _Optional[int] = ..., token: _Optional[str] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class DataWelcome(_message.Message):
    __slots__ = ("version", "instance_id", "max_frame_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    instance_id: str
    max_frame_bytes: int
    def __init__(self, version: _Optional[int] = ..., instance_id: _Optional[str] = ..., max_frame_bytes: _Optional[int] = ...) -> None: ...

class DataTicketRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataTicketResponse(_message.Message):
    __slots__ = ("ticket", "expires_ms")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    expires_ms: int
    def __init__(self, ticket: _Optional[bytes] = ..., expires_ms: _Optional[int] = ...) -> None: ...

class TensorUsageRequest(_message.Message):
    __slots__ = ("top", "device")
    TOP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    top: int
    device: int
    def __init__(self, top: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class TensorUsage(_message.Message):
    __slots__ = ("handle", "device", "calls", "rows")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    device: int
    calls: int
    rows: int
    def __init__(self, handle: _Optional[int] = ..., device: _Optional[int] = ..., calls: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class TensorUsageResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorUsage]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorUsage, _Mapping]]] = ...) -> None: ...
