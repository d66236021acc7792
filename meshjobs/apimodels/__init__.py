"""The bodies of the HTTP API as typed models: what a request may carry and what an answer holds.

Theory of operation: the models are TypedDicts (an answer is a dict built by the node; a key
that is only sometimes there is `NotRequired`, never a null it does not send), and a few named
type aliases (`Digest`, `ItemPayload`, `After`). `schemas()` turns them into the JSON Schemas of
the OpenAPI document's components (meshjobs/openapi.py), so the document says what the models
say. Requests are still parsed by control.py's pure parsers (their messages are part of the
API); tests/test_api_shapes.py checks real answers of a real meshd against these schemas, so an
answer that grows a key the models lack, or loses one they require, fails a test.

Rule 1: an answer model forbids keys it does not name (drift is caught, not tolerated).
Rule 2: descriptions are the documentation: they say what a key means to a client.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from meshjobs.apimodels.cron import (  # noqa: F401
    CatchUp,
    Cron,
    CronList,
    CronPut,
    CronRemoved,
    Overlap,
)
from meshjobs.apimodels.fleet import (  # noqa: F401
    BlobCheck,
    Fleet,
    FleetMember,
    Health,
    LoggedIn,
    LoggedOut,
    Login,
    LoginForm,
    MemberOrder,
    MemberOrderBody,
    MemberStopBody,
    PoolOnMember,
    PoolOrder,
    PoolOrderBody,
    PoolRow,
    Pools,
    PoolSlotsBody,
)
from meshjobs.apimodels.jobs import (  # noqa: F401
    After,
    AfterObject,
    DepCondition,
    Digest,
    Error,
    Forgotten,
    Item,
    ItemPayload,
    ItemState,
    Job,
    JobState,
    Parent,
    PayloadB64,
    PayloadBlob,
    Rerun,
    SubmitSpec,
    Tone,
)
from meshjobs.apimodels.many import (  # noqa: F401
    BulkAnswer,
    BulkChange,
    BulkResult,
    BulkStatus,
    BulkTone,
    Filter,
    FinalJob,
    History,
    HistoryRecord,
    ItemsSummary,
    ToneSet,
)

# --- schemas ------------------------------------------------------------------------------------

MODELS: tuple[Any, ...] = (
    Error, Forgotten, SubmitSpec, Tone, Rerun, Item, Job, Fleet, Health, Digest, ItemPayload,
    After, BulkStatus, BulkChange, BulkTone, BulkAnswer, History, PoolOrder, Pools, PoolOrderBody,
    PoolSlotsBody, MemberOrderBody, MemberStopBody, MemberOrder, CronPut, Cron, CronList,
    CronRemoved, Login, LoginForm, LoggedIn, LoggedOut, BlobCheck)
REF = "#/components/schemas/{model}"


class _NoTitles(GenerateJsonSchema):
    """Schemas without the titles pydantic makes up from key names (noise in a document)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def ref(model: Any) -> dict[str, str]:
    """A reference to a model's schema in the document."""
    return {"$ref": REF.format(model=model.__name__)}


def schemas() -> dict[str, Any]:
    """The JSON Schemas of the models, by name, with references as the OpenAPI document's."""
    _, top = TypeAdapter.json_schemas(
        [(m, "validation", TypeAdapter(m)) for m in MODELS], ref_template=REF,
        schema_generator=_NoTitles)
    out = top["$defs"]
    for schema in out.values():
        schema.pop("title", None)
    return out
