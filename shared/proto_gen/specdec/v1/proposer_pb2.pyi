from shared.proto_gen.specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FeatureDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEATURE_DTYPE_UNSPECIFIED: _ClassVar[FeatureDtype]
    FEATURE_DTYPE_FLOAT16: _ClassVar[FeatureDtype]
    FEATURE_DTYPE_BFLOAT16: _ClassVar[FeatureDtype]
    FEATURE_DTYPE_FLOAT32: _ClassVar[FeatureDtype]

class ProposerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_KIND_UNSPECIFIED: _ClassVar[ProposerKind]
    PROPOSER_KIND_DRAFT_MODEL: _ClassVar[ProposerKind]
    PROPOSER_KIND_NGRAM: _ClassVar[ProposerKind]
    PROPOSER_KIND_EAGLE: _ClassVar[ProposerKind]
    PROPOSER_KIND_SUFFIX: _ClassVar[ProposerKind]
FEATURE_DTYPE_UNSPECIFIED: FeatureDtype
FEATURE_DTYPE_FLOAT16: FeatureDtype
FEATURE_DTYPE_BFLOAT16: FeatureDtype
FEATURE_DTYPE_FLOAT32: FeatureDtype
PROPOSER_KIND_UNSPECIFIED: ProposerKind
PROPOSER_KIND_DRAFT_MODEL: ProposerKind
PROPOSER_KIND_NGRAM: ProposerKind
PROPOSER_KIND_EAGLE: ProposerKind
PROPOSER_KIND_SUFFIX: ProposerKind

class ProposeRequest(_message.Message):
    __slots__ = ("step_id", "sequences", "release_seq_ids", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[ProposeSequence]
    release_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, step_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[ProposeSequence, _Mapping]]] = ..., release_seq_ids: _Optional[_Iterable[str]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ProposeSequence(_message.Message):
    __slots__ = ("seq_id", "committed_len", "new_token_ids", "full_sequence", "k", "sampling_params", "target_features", "draft_position", "tenant", "max_tree_nodes", "min_tree_node_prob")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FULL_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_POSITION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MIN_TREE_NODE_PROB_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    committed_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    full_sequence: bool
    k: int
    sampling_params: _common_pb2.SamplingParams
    target_features: TargetFeatures
    draft_position: int
    tenant: str
    max_tree_nodes: int
    min_tree_node_prob: float
    def __init__(self, seq_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., full_sequence: _Optional[bool] = ..., k: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target_features: _Optional[_Union[TargetFeatures, _Mapping]] = ..., draft_position: _Optional[int] = ..., tenant: _Optional[str] = ..., max_tree_nodes: _Optional[int] = ..., min_tree_node_prob: _Optional[float] = ...) -> None: ...

class TargetFeatures(_message.Message):
    __slots__ = ("start_position", "rows", "hidden_size", "dtype", "data")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    rows: int
    hidden_size: int
    dtype: FeatureDtype
    data: bytes
    def __init__(self, start_position: _Optional[int] = ..., rows: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[FeatureDtype, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("step_id", "drafts", "draft_time_us")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_US_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    drafts: _containers.RepeatedCompositeFieldContainer[Draft]
    draft_time_us: int
    def __init__(self, step_id: _Optional[int] = ..., drafts: _Optional[_Iterable[_Union[Draft, _Mapping]]] = ..., draft_time_us: _Optional[int] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("seq_id", "committed_len", "draft_token_ids", "draft_prob_token_ids", "draft_probs", "draft_prob_counts", "needs_resync", "draft_parents")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROB_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_RESYNC_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    committed_len: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_prob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[float]
    draft_prob_counts: _containers.RepeatedScalarFieldContainer[int]
    needs_resync: bool
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_prob_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[float]] = ..., draft_prob_counts: _Optional[_Iterable[int]] = ..., needs_resync: _Optional[bool] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ("max_tree_nodes", "max_draft_support")
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    max_tree_nodes: int
    max_draft_support: int
    def __init__(self, max_tree_nodes: _Optional[int] = ..., max_draft_support: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("kind", "model", "vocab_size", "tokenizer_fingerprint", "max_k", "max_model_len", "needs_target_features", "target_hidden_size", "feature_dtype", "target_feature_layers", "host_id", "cpus")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NEEDS_TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    kind: ProposerKind
    model: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_k: int
    max_model_len: int
    needs_target_features: bool
    target_hidden_size: int
    feature_dtype: FeatureDtype
    target_feature_layers: _containers.RepeatedScalarFieldContainer[int]
    host_id: str
    cpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[ProposerKind, str]] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_k: _Optional[int] = ..., max_model_len: _Optional[int] = ..., needs_target_features: _Optional[bool] = ..., target_hidden_size: _Optional[int] = ..., feature_dtype: _Optional[_Union[FeatureDtype, str]] = ..., target_feature_layers: _Optional[_Iterable[int]] = ..., host_id: _Optional[str] = ..., cpus: _Optional[_Iterable[int]] = ...) -> None: ...
