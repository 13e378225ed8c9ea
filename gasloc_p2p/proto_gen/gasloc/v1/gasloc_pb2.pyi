from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RejectCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_CODE_UNSPECIFIED: _ClassVar[RejectCode]
    BUSY: _ClassVar[RejectCode]
    VERSION_MISMATCH: _ClassVar[RejectCode]
    FINGERPRINT_MISMATCH: _ClassVar[RejectCode]
    RUN_MISMATCH: _ClassVar[RejectCode]
    BAD_REQUEST: _ClassVar[RejectCode]
    INTERNAL: _ClassVar[RejectCode]
    UNAUTHENTICATED: _ClassVar[RejectCode]
    LINK_OUT_OF_STEP: _ClassVar[RejectCode]
REJECT_CODE_UNSPECIFIED: RejectCode
BUSY: RejectCode
VERSION_MISMATCH: RejectCode
FINGERPRINT_MISMATCH: RejectCode
RUN_MISMATCH: RejectCode
BAD_REQUEST: RejectCode
INTERNAL: RejectCode
UNAUTHENTICATED: RejectCode
LINK_OUT_OF_STEP: RejectCode

class Auth(_message.Message):
    __slots__ = ("public_key", "timestamp", "signature", "target", "nonce", "invitation")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    INVITATION_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    timestamp: float
    signature: bytes
    target: str
    nonce: bytes
    invitation: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., timestamp: _Optional[float] = ..., signature: _Optional[bytes] = ..., target: _Optional[str] = ..., nonce: _Optional[bytes] = ..., invitation: _Optional[bytes] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("protocol_version", "run_id", "model_fingerprint", "peer_id", "codec", "block_size", "fragment_index", "fragment_count", "fragment_numel", "payload_bytes", "payload_digest", "rounds", "public_key", "nonce", "signature", "invitation", "link_state", "link_seed")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    INVITATION_FIELD_NUMBER: _ClassVar[int]
    LINK_STATE_FIELD_NUMBER: _ClassVar[int]
    LINK_SEED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    model_fingerprint: str
    peer_id: str
    codec: str
    block_size: int
    fragment_index: int
    fragment_count: int
    fragment_numel: int
    payload_bytes: int
    payload_digest: bytes
    rounds: int
    public_key: bytes
    nonce: bytes
    signature: bytes
    invitation: bytes
    link_state: bytes
    link_seed: bool
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., peer_id: _Optional[str] = ..., codec: _Optional[str] = ..., block_size: _Optional[int] = ..., fragment_index: _Optional[int] = ..., fragment_count: _Optional[int] = ..., fragment_numel: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., payload_digest: _Optional[bytes] = ..., rounds: _Optional[int] = ..., public_key: _Optional[bytes] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., invitation: _Optional[bytes] = ..., link_state: _Optional[bytes] = ..., link_seed: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("rounds_since_snapshot",)
    ROUNDS_SINCE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    rounds_since_snapshot: int
    def __init__(self, rounds_since_snapshot: _Optional[int] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("signature",)
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    signature: bytes
    def __init__(self, signature: _Optional[bytes] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: RejectCode
    message: str
    def __init__(self, code: _Optional[_Union[RejectCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: RejectCode
    message: str
    def __init__(self, code: _Optional[_Union[RejectCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class ExchangeMsg(_message.Message):
    __slots__ = ("header", "chunk", "ready", "commit", "abort", "reject")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    header: Header
    chunk: Chunk
    ready: Ready
    commit: Commit
    abort: Abort
    reject: Reject
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("probe_endpoint", "probe_cert", "auth", "punch_endpoint", "punch_local")
    PROBE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PROBE_CERT_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    PUNCH_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PUNCH_LOCAL_FIELD_NUMBER: _ClassVar[int]
    probe_endpoint: str
    probe_cert: bytes
    auth: Auth
    punch_endpoint: str
    punch_local: str
    def __init__(self, probe_endpoint: _Optional[str] = ..., probe_cert: _Optional[bytes] = ..., auth: _Optional[_Union[Auth, _Mapping]] = ..., punch_endpoint: _Optional[str] = ..., punch_local: _Optional[str] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("protocol_version", "software_version", "run_id", "peer_id", "model_fingerprint", "step", "rounds", "tokens_per_s", "val_loss", "peers", "exchanges_ok_initiator", "exchanges_ok_responder", "exchanges_failed", "bytes_sent", "bytes_received", "endpoint", "first_val_loss", "algorithm", "averaging_rounds_ok", "averaging_rounds_failed", "averaging_rounds_solo", "last_group_size", "last_averaging_s", "total_averaging_s", "outer_epoch", "resyncs", "probe_ok", "ok", "authenticated", "dht_peer_id", "validation_set", "model", "fragment_syncs", "challenge", "observed", "punch_endpoint", "punch_local")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_OK_INITIATOR_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_OK_RESPONDER_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_ROUNDS_OK_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_ROUNDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_ROUNDS_SOLO_FIELD_NUMBER: _ClassVar[int]
    LAST_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_AVERAGING_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_AVERAGING_S_FIELD_NUMBER: _ClassVar[int]
    OUTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    PROBE_OK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    AUTHENTICATED_FIELD_NUMBER: _ClassVar[int]
    DHT_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_SET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_SYNCS_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    PUNCH_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PUNCH_LOCAL_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    software_version: str
    run_id: str
    peer_id: str
    model_fingerprint: str
    step: int
    rounds: int
    tokens_per_s: float
    val_loss: float
    peers: _containers.RepeatedScalarFieldContainer[str]
    exchanges_ok_initiator: int
    exchanges_ok_responder: int
    exchanges_failed: int
    bytes_sent: int
    bytes_received: int
    endpoint: str
    first_val_loss: float
    algorithm: str
    averaging_rounds_ok: int
    averaging_rounds_failed: int
    averaging_rounds_solo: int
    last_group_size: int
    last_averaging_s: float
    total_averaging_s: float
    outer_epoch: int
    resyncs: int
    probe_ok: bool
    ok: bool
    authenticated: bool
    dht_peer_id: str
    validation_set: str
    model: str
    fragment_syncs: _containers.RepeatedCompositeFieldContainer[FragmentSync]
    challenge: bytes
    observed: str
    punch_endpoint: str
    punch_local: str
    def __init__(self, protocol_version: _Optional[int] = ..., software_version: _Optional[str] = ..., run_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., step: _Optional[int] = ..., rounds: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., val_loss: _Optional[float] = ..., peers: _Optional[_Iterable[str]] = ..., exchanges_ok_initiator: _Optional[int] = ..., exchanges_ok_responder: _Optional[int] = ..., exchanges_failed: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., endpoint: _Optional[str] = ..., first_val_loss: _Optional[float] = ..., algorithm: _Optional[str] = ..., averaging_rounds_ok: _Optional[int] = ..., averaging_rounds_failed: _Optional[int] = ..., averaging_rounds_solo: _Optional[int] = ..., last_group_size: _Optional[int] = ..., last_averaging_s: _Optional[float] = ..., total_averaging_s: _Optional[float] = ..., outer_epoch: _Optional[int] = ..., resyncs: _Optional[int] = ..., probe_ok: _Optional[bool] = ..., ok: _Optional[bool] = ..., authenticated: _Optional[bool] = ..., dht_peer_id: _Optional[str] = ..., validation_set: _Optional[str] = ..., model: _Optional[str] = ..., fragment_syncs: _Optional[_Iterable[_Union[FragmentSync, _Mapping]]] = ..., challenge: _Optional[bytes] = ..., observed: _Optional[str] = ..., punch_endpoint: _Optional[str] = ..., punch_local: _Optional[str] = ...) -> None: ...

class FragmentSync(_message.Message):
    __slots__ = ("index", "offset", "numel", "syncs_ok", "syncs_failed", "syncs_solo", "last_start_step", "epoch", "bytes_sent", "wait_s", "resyncs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    SYNCS_OK_FIELD_NUMBER: _ClassVar[int]
    SYNCS_FAILED_FIELD_NUMBER: _ClassVar[int]
    SYNCS_SOLO_FIELD_NUMBER: _ClassVar[int]
    LAST_START_STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    numel: int
    syncs_ok: int
    syncs_failed: int
    syncs_solo: int
    last_start_step: int
    epoch: int
    bytes_sent: int
    wait_s: float
    resyncs: int
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., syncs_ok: _Optional[int] = ..., syncs_failed: _Optional[int] = ..., syncs_solo: _Optional[int] = ..., last_start_step: _Optional[int] = ..., epoch: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., wait_s: _Optional[float] = ..., resyncs: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("protocol_version", "run_id", "model_fingerprint", "auth")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    model_fingerprint: str
    auth: Auth
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., auth: _Optional[_Union[Auth, _Mapping]] = ...) -> None: ...

class StateMeta(_message.Message):
    __slots__ = ("protocol_version", "model_fingerprint", "numel", "step", "rounds", "momentum", "total_bytes", "body_crc32")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BODY_CRC32_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_fingerprint: str
    numel: int
    step: int
    rounds: int
    momentum: str
    total_bytes: int
    body_crc32: int
    def __init__(self, protocol_version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., numel: _Optional[int] = ..., step: _Optional[int] = ..., rounds: _Optional[int] = ..., momentum: _Optional[str] = ..., total_bytes: _Optional[int] = ..., body_crc32: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("meta", "data", "reject")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    meta: StateMeta
    data: bytes
    reject: Reject
    def __init__(self, meta: _Optional[_Union[StateMeta, _Mapping]] = ..., data: _Optional[bytes] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ManifestReply(_message.Message):
    __slots__ = ("manifest_json",)
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    def __init__(self, manifest_json: _Optional[str] = ...) -> None: ...

class RelayRequest(_message.Message):
    __slots__ = ("target_peer", "token", "auth")
    TARGET_PEER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    target_peer: str
    token: bytes
    auth: Auth
    def __init__(self, target_peer: _Optional[str] = ..., token: _Optional[bytes] = ..., auth: _Optional[_Union[Auth, _Mapping]] = ...) -> None: ...

class RelayEvent(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    def __init__(self, token: _Optional[bytes] = ...) -> None: ...

class RelayMsg(_message.Message):
    __slots__ = ("open", "data")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    open: RelayRequest
    data: bytes
    def __init__(self, open: _Optional[_Union[RelayRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
