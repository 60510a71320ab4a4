"""The room worker's configuration (``runtime/_config.py``); test names cite
``docs/design/config.md`` (C1…). Pure and fast: no process, no clock; files only under
``tmp_path``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest

from runtime._boundary._gate import PI_TOOL_CLASSES
from runtime._boundary._tools import RUNTIME_TOOLS
from runtime._config import (
    DEFAULT_GRANTS,
    KNOWN_TOOLS,
    PERSONA_MAX_BYTES,
    Caps,
    ModelConfig,
    RoomConfig,
    RoomWorkerConfig,
    Thresholds,
    config_from_dict,
    declared_class,
    load_config,
    redact_passwords,
    validate_config,
)
from runtime._errors import ConfigError, DeliveryError, ReasonCode
from runtime._records import ReplayClass

BASE: Final = Path("/srv/pi-runtime")

COMPLETE: Final = """\
state_dir = "var/state"
work_root = "var/work"
agent = "pi"
pi_home = "/opt/pi"
persona = "You are Clank. Answer [[stay-silent]] when nobody asked you anything."
default_grants = ["send_text_update"]

[model]
provider = "upstream"
model = "gpt-x"
base_url = "https://models.example.com/v1"
api_key_env = "UPSTREAM_API_KEY"
context_window = 200000
max_tokens = 8192

[rooms."guild:1:2"]
grants = ["send_text_update", "read"]
actors = { "42" = ["bash", "edit"] }

[rooms."dm:7"]

[tool_classes]
read = "never"

[thresholds]
stall_seconds = 600
abort_grace_seconds = 45
tool_lease_max_seconds = 1800
tick_seconds = 2.5
typing_refresh_seconds = 8
upstream_inactivity_seconds = 540
keepalive_seconds = 10
idle_stop_seconds = 1200
drain_timeout_seconds = 0

[caps]
max_live_workers = 8
queue_limit = 64
recovery_attempts = 2
text_update_chars = 500
max_text_chars = 8000
max_history_items = 20
"""


def refused(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data, base=BASE)
    assert caught.value.code is ReasonCode.CONFIG_INVALID
    assert str(caught.value).startswith(f"config_invalid: {caught.value.setting}: ")
    return caught.value


# ------------------------------------------------------------------------ valid configurations


def test_defaults_are_valid_and_resolve_paths_against_the_base() -> None:
    config = validate_config(RoomWorkerConfig(), base=BASE)
    assert config.state_dir == str(BASE / "state")
    assert config.work_root == str(BASE / "work")
    assert config.agent == "fake"
    assert config.model == ModelConfig()
    assert config.default_grants == DEFAULT_GRANTS == frozenset({"send_text_update", "attach"})
    assert config.rooms is None
    assert config.thresholds == Thresholds()
    assert config.caps == Caps()
    assert config_from_dict({}, base=BASE) == config
    assert validate_config(config, base=Path("/elsewhere")) == config  # absolute stays put


def test_defaults_without_a_base_resolve_against_the_working_directory() -> None:
    config = validate_config(RoomWorkerConfig())
    assert config.state_dir == os.path.join(os.getcwd(), "state")


def test_complete_toml_file_round_trip(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    file = tmp_path / "etc" / "pi-runtime.toml"
    file.write_text(COMPLETE)
    config = load_config(file)
    assert config.state_dir == str(tmp_path / "etc" / "var" / "state")
    assert config.work_root == str(tmp_path / "etc" / "var" / "work")
    assert config.pi_home == "/opt/pi"
    assert config.agent == "pi"
    assert config.persona is not None
    assert "[[stay-silent]]" in config.persona
    assert config.model == ModelConfig(
        provider="upstream",
        model="gpt-x",
        base_url="https://models.example.com/v1",
        api_key_env="UPSTREAM_API_KEY",
        context_window=200_000,
        max_tokens=8192,
    )
    assert config.rooms == {
        "guild:1:2": RoomConfig(
            grants=frozenset({"send_text_update", "read"}),
            actors={"42": frozenset({"bash", "edit"})},
        ),
        "dm:7": RoomConfig(),
    }
    assert config.tool_classes == {"read": ReplayClass.NEVER}
    assert config.thresholds == Thresholds(
        stall_seconds=600.0,
        abort_grace_seconds=45.0,
        tool_lease_max_seconds=1800.0,
        tick_seconds=2.5,
        typing_refresh_seconds=8.0,
        upstream_inactivity_seconds=540.0,
        keepalive_seconds=10.0,
        idle_stop_seconds=1200.0,
        drain_timeout_seconds=0.0,
    )
    assert config.caps == Caps(
        max_live_workers=8,
        queue_limit=64,
        recovery_attempts=2,
        text_update_chars=500,
        max_text_chars=8000,
        max_history_items=20,
    )
    # the loaded object is a fixed point: as builtins and back it is the same configuration
    again = config_from_dict(msgspec.to_builtins(config), base=Path("/elsewhere"))
    assert again == config


def test_the_example_in_the_design_page_loads(tmp_path: Path) -> None:
    page = Path(__file__).parent.parent / "docs" / "design" / "config.md"
    text = page.read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    file = tmp_path / "pi-runtime.toml"
    file.write_text(example)
    assert load_config(file).rooms is not None


def test_embedder_objects_are_type_checked_and_normalised() -> None:
    built = RoomWorkerConfig(
        state_dir=Path("/var/lib/pi/state"),  # type: ignore[arg-type]
        work_root="~/pi-work",
        rooms={"dm:1": RoomConfig(grants=["read"])},  # type: ignore[arg-type]
    )
    config = validate_config(built, base=BASE)
    assert config.state_dir == "/var/lib/pi/state"
    assert config.work_root == str(Path("~/pi-work").expanduser())
    assert config.rooms == {"dm:1": RoomConfig(grants=frozenset({"read"}))}
    with pytest.raises(ConfigError) as caught:
        validate_config(RoomWorkerConfig(caps=Caps(queue_limit="32")), base=BASE)  # type: ignore[arg-type]
    assert caught.value.setting == "caps.queue_limit"
    with pytest.raises(ConfigError) as caught:
        validate_config(RoomWorkerConfig(persona=object()), base=BASE)  # type: ignore[arg-type]
    assert caught.value.setting == "persona"


# ----------------------------------------------------------------------- the file itself


def test_an_unreadable_or_malformed_file_is_named_by_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(missing)
    assert caught.value.setting == str(missing)
    broken = tmp_path / "broken.toml"
    broken.write_text("[thresholds\nstall_seconds = 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(broken)
    assert caught.value.setting == str(broken)
    assert "not valid TOML" in caught.value.message


def test_an_error_in_a_file_names_the_setting(tmp_path: Path) -> None:
    file = tmp_path / "pi-runtime.toml"
    file.write_text('[rooms."dm:1"]\ngrants = ["read", "shell"]\n')
    with pytest.raises(ConfigError) as caught:
        load_config(file)
    assert caught.value.setting == 'rooms."dm:1".grants'
    assert "'shell'" in caught.value.message


# ---------------------------------------------------------------------------- invariants


@pytest.mark.parametrize(
    ("data", "setting"),
    [
        pytest.param({"stall_seconds": 1}, "stall_seconds", id="unknown-top-level"),
        pytest.param({"thresholds": {"stall": 1}}, "thresholds.stall", id="unknown-nested"),
        pytest.param({"model": {"key": "x"}}, "model.key", id="unknown-in-model"),
        pytest.param(
            {"rooms": {"dm:1": {"grant": ["read"]}}}, 'rooms."dm:1".grant', id="unknown-in-room"
        ),
        pytest.param(
            {"rooms": {"dm:1": {}, "dm:2": {"nope": 1}}}, 'rooms."dm:2".nope', id="second-room"
        ),
        pytest.param(
            {"thresholds": {"stall_seconds": "300"}},
            "thresholds.stall_seconds",
            id="string-for-float",
        ),
        pytest.param(
            {"thresholds": {"tick_seconds": True}}, "thresholds.tick_seconds", id="bool-for-float"
        ),
        pytest.param({"caps": {"queue_limit": 3.5}}, "caps.queue_limit", id="float-for-int"),
        pytest.param({"agent": "claude"}, "agent", id="unknown-agent"),
        pytest.param({"default_grants": "read"}, "default_grants", id="string-for-list"),
        pytest.param({"rooms": {"dm:1": 3}}, 'rooms."dm:1"', id="room-not-a-table"),
        pytest.param(
            {"rooms": {"dm:1": {"actors": {"7": ["read"], "8": [1]}}}},
            'rooms."dm:1".actors.8',
            id="actor-grant-type",
        ),
        pytest.param({"tool_classes": {"read": "maybe"}}, "tool_classes.read", id="bad-class"),
        pytest.param({"state_dir": 5}, "state_dir", id="int-for-path"),
        pytest.param({"state_dir": ""}, "state_dir", id="empty-path"),
        pytest.param({"pi_home": "~no-such-user-here/pi"}, "pi_home", id="unknown-home-directory"),
    ],
)
def test_c1_unknown_or_mistyped_setting_is_named(data: dict[str, Any], setting: str) -> None:
    assert refused(data).setting == setting


def test_c1_unknown_setting_message() -> None:
    assert refused({"thresholds": {"stall": 1}}).message == "thresholds.stall: unknown setting"


@pytest.mark.parametrize(
    ("state_dir", "work_root"),
    [
        pytest.param("state", "state/work", id="work-inside-state"),
        pytest.param("state", "state", id="same"),
        pytest.param("state", "./state/../state/lanes", id="after-normalising"),
        pytest.param("data/state", "data", id="state-inside-work"),
        pytest.param("/srv/state", "/srv/state/rooms", id="absolute"),
    ],
)
def test_c2_work_root_must_not_overlap_the_state_dir(state_dir: str, work_root: str) -> None:
    assert refused({"state_dir": state_dir, "work_root": work_root}).setting == "work_root"


def test_c2_work_root_through_a_symlink_into_the_state_dir(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "work").symlink_to(tmp_path / "state")
    with pytest.raises(ConfigError) as caught:
        config_from_dict({}, base=tmp_path)
    assert caught.value.setting == "work_root"


@pytest.mark.parametrize("setting", ["state_dir", "work_root"])
def test_c2_a_path_that_is_not_utf8_is_refused_by_name(setting: str) -> None:
    """A directory name of bytes that are not UTF-8 (they reach Python as lone surrogates)
    is refused, naming the setting: the journal records paths as text, and such a path
    would fail there with a traceback instead."""
    odd = os.fsdecode(b"odd\xffdir")
    assert refused({setting: odd}).setting == setting


def test_c2_sibling_directories_are_fine() -> None:
    config = config_from_dict({"state_dir": "state", "work_root": "state-work"}, base=BASE)
    assert config.work_root == str(BASE / "state-work")


@pytest.mark.parametrize(
    ("data", "setting"),
    [
        pytest.param({"model": {"base_url": "ftp://x/v1"}}, "model.base_url", id="scheme"),
        pytest.param({"model": {"base_url": "https:///v1"}}, "model.base_url", id="no-host"),
        pytest.param({"model": {"provider": ""}}, "model.provider", id="empty-provider"),
        pytest.param({"model": {"model": "gpt x"}}, "model.model", id="space-in-model"),
        pytest.param({"model": {"context_window": 0}}, "model.context_window", id="window"),
        pytest.param(
            {"model": {"context_window": 1000, "max_tokens": 1001}},
            "model.max_tokens",
            id="tokens-over-window",
        ),
    ],
)
def test_c3_model_route_is_usable(data: dict[str, Any], setting: str) -> None:
    assert refused(data).setting == setting


def test_c3_no_upstream_means_the_scripted_model_for_either_agent() -> None:
    assert config_from_dict({}, base=BASE).model.base_url is None
    assert config_from_dict({"agent": "pi"}, base=BASE).model.base_url is None
    route = {"base_url": "http://127.0.0.1:8080/v1", "api_key_env": "OPENAI_API_KEY"}
    assert config_from_dict({"agent": "pi", "model": route}, base=BASE).agent == "pi"


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("sk-proj-abcdEFGH1234", id="openai-shaped"),
        pytest.param("abcdef0123456789abcdef0123456789", id="hex"),
        pytest.param("$OPENAI_API_KEY", id="shell-reference"),
        pytest.param("openai_api_key", id="lower-case"),
        pytest.param("", id="empty"),
    ],
)
def test_c4_api_key_env_is_a_variable_name_never_a_key(value: str) -> None:
    error = refused({"model": {"api_key_env": value}})
    assert error.setting == "model.api_key_env"
    if value:
        assert value not in str(error)


def test_c4_base_url_carries_no_credentials() -> None:
    error = refused({"model": {"base_url": "https://user:s3cret@models.example.com/v1"}})
    assert error.setting == "model.base_url"
    assert "s3cret" not in str(error)


@pytest.mark.parametrize(
    "query",
    ["key=s3cret", "api_key=s3cret", "x-api-key=s3cret", "access_token=s3cret", "sig=s3cret",
     "api-version=1&Secret=s3cret", "auth=s3cret", "password=s3cret"],
)  # fmt: skip
def test_c4_base_url_carries_no_key_in_its_query(query: str) -> None:
    """C4: a key in the URL's query (``?key=…``, as some providers take one) is a secret in
    the configuration too: refused, never echoed. Before, it was taken, and the URL — frozen
    into every task's route as its endpoint — reached the lane log, ``task show`` and the
    operator page."""
    error = refused({"model": {"base_url": f"https://models.example.com/v1?{query}"}})
    assert error.setting == "model.base_url"
    assert "s3cret" not in str(error)


def test_c4_base_url_may_carry_a_query_that_holds_no_key() -> None:
    """An ``api-version`` (Azure's) names no secret: taken as given."""
    url = "https://models.example.com/v1?api-version=2024-06-01"
    assert config_from_dict({"model": {"base_url": url}}).model.base_url == url


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s3cret@db.example.com/pi",
        "postgresql://db.example.com/pi?password=s3cret",
        "host=db.example.com dbname=pi password=s3cret",
        "host=db.example.com sslpassword=s3cret dbname=pi",
    ],
)
def test_c4_store_url_carries_no_password(url: str) -> None:
    """C4: a PostgreSQL DSN with a password in it is refused without echoing it; libpq reads
    the password from PGPASSWORD, ~/.pgpass or a service file."""
    error = refused({"store": {"url": url}})
    assert error.setting == "store.url"
    assert "s3cret" not in str(error)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:s3cret@db.example.com/pi",
        "postgres://:s3cret@db.example.com",
        "postgresql://app:a@b:s3cret@db.example.com/pi",
        "postgresql://db.example.com/pi?sslmode=require&password=s3cret&x=y",
        "host=db.example.com dbname=pi password=s3cret",
        "host=db.example.com sslpassword=s3cret dbname=pi",
        "host=db.example.com password = s3cret",
        "host=db.example.com PASSWORD='it''s s3cret' dbname=pi",
        r"host=db.example.com password='a \' s3cret' dbname=pi",
        "PGPASSWORD=s3cret",
    ],
)
@pytest.mark.parametrize("one_value", [False, True])
def test_c4_o17_redact_passwords_hides_each_form_of_password(dsn: str, one_value: bool) -> None:
    """C4, O17: every form of password C4 refuses in ``store.url`` (and ``PGPASSWORD=``) is
    hidden by ``redact_passwords``, alone or quoted inside a longer text, and the rest of the
    DSN stays readable."""
    assert "s3cret" not in redact_passwords(dsn, one_value=one_value)
    assert "s3cret" not in redact_passwords(f"argument: invalid value: {dsn!r} (see --help)")
    assert "db.example.com" in redact_passwords(dsn) or dsn.startswith("PGPASSWORD")


def test_o17_redact_passwords_in_one_value_takes_a_password_with_spaces() -> None:
    """A URL's password cannot be told from the text around it when it has spaces; one
    argument can be read whole."""
    dsn = "postgresql://app:my s3cret@db.example.com/pi"
    assert redact_passwords(dsn, one_value=True) == "postgresql://app:***@db.example.com/pi"
    plain = "nothing secret: host=db user=ann"
    assert redact_passwords(plain) == plain


@pytest.mark.parametrize(
    "url", ["postgresql://app@db.example.com/pi", "postgresql://app:@/pi?host=/run/pg", "dbname=pi"]
)
def test_c4_store_url_without_a_password_is_taken(url: str) -> None:
    assert config_from_dict({"store": {"url": url}}, base=BASE).store.url == url


@pytest.mark.parametrize(
    "persona",
    [
        pytest.param("", id="empty"),
        pytest.param("  \n", id="blank"),
        pytest.param("be brief\0", id="nul"),
        pytest.param("x" * (PERSONA_MAX_BYTES + 1), id="too-long"),
        pytest.param("é" * (PERSONA_MAX_BYTES // 2 + 1), id="too-long-in-bytes"),
    ],
)
def test_c5_persona_fits_one_argument(persona: str) -> None:
    assert refused({"persona": persona}).setting == "persona"


@pytest.mark.parametrize(
    ("data", "setting"),
    [
        pytest.param({"rooms": {"dm 1": {}}}, 'rooms."dm 1"', id="space"),
        pytest.param({"rooms": {"channel:1": {}}}, 'rooms."channel:1"', id="unknown-shape"),
        pytest.param({"rooms": {"guild:1": {}}}, 'rooms."guild:1"', id="guild-without-channel"),
        pytest.param({"rooms": {"room:": {}}}, 'rooms."room:"', id="empty-opaque"),
        pytest.param({"rooms": {}}, "rooms", id="empty-table"),
        pytest.param(
            {"rooms": {"dm:1": {"actors": {"": ["read"]}}}}, 'rooms."dm:1".actors.""', id="actor"
        ),
        pytest.param(
            {"rooms": {"dm:1": {"actors": {"a" * 201: []}}}},
            f'rooms."dm:1".actors.{"a" * 201}',
            id="long-actor",
        ),
    ],
)
def test_c6_rooms_and_actors_are_valid_ids(data: dict[str, Any], setting: str) -> None:
    assert refused(data).setting == setting


@pytest.mark.parametrize(
    ("data", "setting"),
    [
        pytest.param({"default_grants": ["read", "shell"]}, "default_grants", id="default"),
        pytest.param(
            {"rooms": {"dm:1": {"grants": ["send_text_update", "Bash"]}}},
            'rooms."dm:1".grants',
            id="room",
        ),
        pytest.param(
            {"rooms": {"room:!abc:matrix.org": {"grants": ["rm"]}}},
            'rooms."room:!abc:matrix.org".grants',
            id="opaque-room",
        ),
        pytest.param(
            {"rooms": {"dm:1": {"actors": {"42": ["read"], "43": ["sudo"]}}}},
            'rooms."dm:1".actors.43',
            id="actor",
        ),
    ],
)
def test_c7_every_grant_names_a_known_tool(data: dict[str, Any], setting: str) -> None:
    error = refused(data)
    assert error.setting == setting
    assert "known tools: attach, bash, " in error.message


def test_c7_known_tools_are_pis_and_the_runtimes() -> None:
    assert {"read", "bash", "edit", "write"} <= KNOWN_TOOLS
    assert frozenset(PI_TOOL_CLASSES) | frozenset(RUNTIME_TOOLS) == KNOWN_TOOLS
    everything = sorted(KNOWN_TOOLS)
    config = config_from_dict({"default_grants": everything}, base=BASE)
    assert config.default_grants == KNOWN_TOOLS


@pytest.mark.parametrize(
    ("classes", "setting"),
    [
        pytest.param({"bash": "safe"}, "tool_classes.bash", id="bash-safe"),
        pytest.param({"write": "receipt"}, "tool_classes.write", id="write-receipt"),
        pytest.param({"send_text_update": "safe"}, "tool_classes.send_text_update", id="send"),
        pytest.param({"mcp_search": "safe"}, "tool_classes.mcp_search", id="unknown-tool"),
    ],
)
def test_c8_tool_class_overrides_only_tighten(classes: dict[str, str], setting: str) -> None:
    assert refused({"tool_classes": classes}).setting == setting


def test_c8_a_stricter_override_is_what_the_gate_gets() -> None:
    config = config_from_dict({"tool_classes": {"read": "never", "bash": "never"}}, base=BASE)
    classes = config.replay_classes()
    assert classes["read"] is ReplayClass.NEVER
    assert set(classes) == KNOWN_TOOLS
    default = RoomWorkerConfig().replay_classes()
    assert default == {name: declared_class(name) for name in KNOWN_TOOLS}
    assert default["read"] is ReplayClass.SAFE
    assert declared_class("unknown") is ReplayClass.NEVER


@pytest.mark.parametrize(
    ("thresholds", "setting"),
    [
        pytest.param({"stall_seconds": -1}, "thresholds.stall_seconds", id="negative-stall"),
        pytest.param({"tick_seconds": 0}, "thresholds.tick_seconds", id="zero-tick"),
        pytest.param({"keepalive_seconds": float("nan")}, "thresholds.keepalive_seconds", id="nan"),
        pytest.param({"idle_stop_seconds": float("inf")}, "thresholds.idle_stop_seconds", id="inf"),
        pytest.param(
            {"drain_timeout_seconds": -0.5}, "thresholds.drain_timeout_seconds", id="drain"
        ),
        pytest.param(
            {"abort_grace_seconds": 0}, "thresholds.abort_grace_seconds", id="zero-abort-grace"
        ),
        pytest.param(
            {"tool_lease_max_seconds": float("inf")},
            "thresholds.tool_lease_max_seconds",
            id="infinite-lease",
        ),
        pytest.param(
            {"tool_lease_max_seconds": -600}, "thresholds.tool_lease_max_seconds", id="lease"
        ),
    ],
)
def test_c9_thresholds_are_finite_and_positive(thresholds: dict[str, Any], setting: str) -> None:
    assert refused({"thresholds": thresholds}).setting == setting


_INF: Final = float("inf")


@pytest.mark.parametrize(
    ("data", "setting"),
    [
        pytest.param(
            {"retention": {"idempotency_days": _INF, "forget_days": _INF}},
            "retention.idempotency_days",
            id="keep-forever",
        ),
        pytest.param({"retention": {"forget_days": 1e300}}, "retention.forget_days", id="huge"),
        pytest.param({"retention": {"sweep_hours": _INF}}, "retention.sweep_hours", id="sweep"),
        pytest.param(
            {"retention": {"compact_hours": _INF}}, "retention.compact_hours", id="compact"
        ),
        pytest.param(
            {"backoff": {"first_seconds": _INF, "max_seconds": _INF}},
            "backoff.first_seconds",
            id="infinite-wait",
        ),
        pytest.param({"backoff": {"max_seconds": 1e300}}, "backoff.max_seconds", id="huge-wait"),
        pytest.param(
            {"backoff": {"deadline_minutes": _INF}}, "backoff.deadline_minutes", id="deadline"
        ),
        pytest.param({"store": {"lease_seconds": _INF}}, "store.lease_seconds", id="lease"),
        pytest.param({"store": {"poll_seconds": 1e300}}, "store.poll_seconds", id="poll"),
        pytest.param(
            {"store": {"task_takeover_seconds": _INF}}, "store.task_takeover_seconds", id="takeover"
        ),
        pytest.param({"server": {"hello_seconds": _INF}}, "server.hello_seconds", id="hello"),
        pytest.param(
            {"server": {"heap_freeze_seconds": _INF}}, "server.heap_freeze_seconds", id="freeze"
        ),
        pytest.param(
            {"thresholds": {"idle_stop_seconds": 1e300}}, "thresholds.idle_stop_seconds", id="idle"
        ),
    ],
)
def test_c9_every_time_is_finite_and_fits_a_record(data: dict[str, Any], setting: str) -> None:
    """TOML has ``inf`` (it reads like "forever") and any double: a time of every table is
    finite and at most a hundred years, or it is refused naming it — it becomes a wall-clock
    time in milliseconds in a record (a forget-after time, a park's next attempt)."""
    error = refused(data)
    assert error.setting == setting
    assert "hundred years" in error.message


def test_c9_a_hundred_years_is_the_longest_time() -> None:
    config = config_from_dict(
        {"retention": {"journal_days": 36_500, "idempotency_days": 36_500, "forget_days": 36_500}},
        base=BASE,
    )
    assert config.retention.forget_days == 36_500


def test_c9_a_zero_drain_timeout_means_cancel_at_once() -> None:
    config = config_from_dict({"thresholds": {"drain_timeout_seconds": 0}}, base=BASE)
    assert config.thresholds.drain_timeout_seconds == 0.0


@pytest.mark.parametrize(
    ("thresholds", "setting"),
    [
        pytest.param({"tick_seconds": 301}, "thresholds.tick_seconds", id="tick-over-stall"),
        pytest.param(
            {"abort_grace_seconds": 300},
            "thresholds.abort_grace_seconds",
            id="abort-grace-equals-stall",
        ),
        pytest.param(
            {"stall_seconds": 20, "tick_seconds": 1},
            "thresholds.abort_grace_seconds",
            id="stall-below-abort-grace",
        ),
        pytest.param(
            {"upstream_inactivity_seconds": 300},
            "thresholds.upstream_inactivity_seconds",
            id="inactivity-equals-stall",
        ),
        pytest.param(
            {"stall_seconds": 200}, "thresholds.upstream_inactivity_seconds", id="stall-lowered"
        ),
        pytest.param(
            {"typing_refresh_seconds": 300}, "thresholds.typing_refresh_seconds", id="typing"
        ),
        pytest.param(
            {"keepalive_seconds": 270}, "thresholds.keepalive_seconds", id="keepalive-too-slow"
        ),
    ],
)
def test_c10_timers_fit_inside_the_stall_backstop(thresholds: dict[str, Any], setting: str) -> None:
    assert refused({"thresholds": thresholds}).setting == setting


def test_c10_tick_may_equal_stall() -> None:
    config = config_from_dict(
        {
            "thresholds": {
                "stall_seconds": 10,
                "abort_grace_seconds": 2,
                "tick_seconds": 10,
                "typing_refresh_seconds": 8,
                "upstream_inactivity_seconds": 9,
                "keepalive_seconds": 1,
            }
        },
        base=BASE,
    )
    assert config.thresholds.tick_seconds == config.thresholds.stall_seconds


@pytest.mark.parametrize("cap", [field.name for field in msgspec.structs.fields(Caps)])
def test_c11_every_cap_is_at_least_one(cap: str) -> None:
    assert refused({"caps": {cap: 0}}).setting == f"caps.{cap}"


# ----------------------------------------------------------------------- authority (C12)


def test_c12_without_rooms_every_valid_room_gets_the_default_grants() -> None:
    config = config_from_dict({}, base=BASE)
    for room in ("dm:1", "guild:a:b", "room:!x:matrix.org"):
        assert config.check_served(room) == room
        assert config.grants_for(room, "42") == DEFAULT_GRANTS
        assert config.standing_grants(room) == DEFAULT_GRANTS
        assert not config.is_privileged(room, "42")


def test_c12_an_invalid_room_is_refused_as_invalid() -> None:
    config = config_from_dict({}, base=BASE)
    assert config.grants_for("../etc", "42") is None
    with pytest.raises(DeliveryError) as caught:
        config.check_served("../etc")
    assert caught.value.code is ReasonCode.ROOM_INVALID
    with pytest.raises(DeliveryError):
        config.standing_grants("dm:")
    assert not config.is_privileged("dm 1", "42")


def test_c12_a_rooms_table_refuses_every_unlisted_room() -> None:
    config = config_from_dict({"rooms": {"dm:1": {}}}, base=BASE)
    assert config.grants_for("dm:1", "42") == DEFAULT_GRANTS  # listed without grants
    assert config.grants_for("dm:2", "42") is None
    with pytest.raises(DeliveryError) as caught:
        config.check_served("dm:2")
    assert caught.value.code is ReasonCode.ROOM_REFUSED
    assert not config.is_privileged("dm:2", "42")
    with pytest.raises(DeliveryError) as caught:
        config.standing_grants("dm:2")
    assert caught.value.code is ReasonCode.ROOM_REFUSED


def test_c12_actor_extras_make_a_delivery_privileged() -> None:
    config = config_from_dict(
        {
            "default_grants": [],
            "rooms": {
                "guild:1:2": {
                    "grants": ["send_text_update", "read"],
                    "actors": {"42": ["bash"], "43": ["read"]},
                },
                "dm:9": {},
            },
        },
        base=BASE,
    )
    room = "guild:1:2"
    assert config.standing_grants(room) == {"send_text_update", "read"}
    assert config.grants_for(room, "42") == frozenset({"send_text_update", "read", "bash"})
    assert config.is_privileged(room, "42")
    # extras inside the standing set add nothing: not privileged
    assert config.grants_for(room, "43") == frozenset({"send_text_update", "read"})
    assert not config.is_privileged(room, "43")
    # a room's own grants, however wide, are its standing set: not privileged
    assert not config.is_privileged(room, "someone")
    # an empty default grant is a room with no tools at all
    assert config.grants_for("dm:9", "42") == frozenset()
    # what an admission asks (the room looked up once) answers both questions the same way
    for asked, actor in ((room, "42"), (room, "43"), (room, "x"), ("dm:9", "42"), ("dm:8", "1")):
        grants = config.grants_for(asked, actor)
        expected = None if grants is None else (grants, config.is_privileged(asked, actor))
        assert config.authority_of(asked, actor) == expected


# -------------------------------------------------------------------- integers (C13)


def _integer_settings() -> list[tuple[str, str]]:
    """Every integer setting of every table but ``[watchdog]`` (WD9 bounds its own), as
    ``(table, field)``: a setting added later is covered without being listed."""
    found = []
    for table in msgspec.structs.fields(RoomWorkerConfig):
        if table.name == "watchdog" or not isinstance(table.default, msgspec.Struct):
            continue
        for field in msgspec.structs.fields(type(table.default)):
            if type(field.default) is int:
                found.append((table.name, field.name))
    return found


_INTEGERS: Final = _integer_settings()


_MAX_TOKENS: Final = ("model", "max_tokens")
"""C3 bounds it by ``model.context_window`` (C13's bound of that is its own too)."""


def _with(table: str, name: str, value: int) -> dict[str, Any]:
    data: dict[str, Any] = {table: {name: value}}
    if (table, name) == _MAX_TOKENS:
        data["model"]["context_window"] = min(value, 2**31 - 1)
    if (table, name) == ("caps", "text_update_chars"):  # one frame (C15): the largest
        data["server"] = {"max_frame_bytes": 2**28}
    return data


def _bound(table: str, name: str) -> int:
    """The bound the refusal of ``10**30`` states."""
    if (table, name) == _MAX_TOKENS:
        table, name = "model", "context_window"
    message = refused(_with(table, name, 10**30)).message
    return int(message.split("at most ")[1].split()[0])


def test_c13_the_integer_settings_are_the_expected_ones() -> None:
    """The enumeration above finds the settings (so the tests below test something)."""
    assert {("model", "context_window"), ("model", "max_tokens"), ("caps", "queue_limit"),
            ("attachments", "max_bytes"), ("server", "max_frame_bytes"),
            ("retention", "compact_bytes_per_second"), ("backoff", "max_attempts")} <= set(
        _INTEGERS
    )  # fmt: skip


@pytest.mark.parametrize("huge", [2**31, 2**63, 10**30], ids=["2**31", "2**63", "10**30"])
@pytest.mark.parametrize(("table", "name"), _INTEGERS, ids=[".".join(i) for i in _INTEGERS])
def test_c13_an_integer_too_large_for_where_it_goes_is_refused(
    table: str, name: str, huge: int
) -> None:
    """C13: TOML (and Python) integers have no bound; ``context_window = 10**30`` was taken
    and written into Pi's ``models.json``, ``attachments.max_bytes = 2**63`` made every
    ``attach`` fail with an ``OverflowError`` (a C ``ssize_t`` read size). Each integer has
    an upper bound, and a value past it is refused naming the setting."""
    error = refused(_with(table, name, huge))
    assert error.setting == f"{table}.{name}"
    past_the_window = (table, name) == _MAX_TOKENS and huge > 2**31 - 1
    assert ("must not exceed model.context_window" if past_the_window else "at most") in (
        error.message
    )


@pytest.mark.parametrize(("table", "name"), _INTEGERS, ids=[".".join(i) for i in _INTEGERS])
def test_c13_the_bound_itself_is_taken_and_one_more_is_not(table: str, name: str) -> None:
    bound = _bound(table, name)
    config = config_from_dict(_with(table, name, bound), base=BASE)
    assert getattr(getattr(config, table), name) == bound
    assert refused(_with(table, name, bound + 1)).setting == f"{table}.{name}"


def test_c13_an_embedders_object_is_bounded_too() -> None:
    model = ModelConfig(context_window=10**30, max_tokens=10**29)
    with pytest.raises(ConfigError) as caught:
        validate_config(RoomWorkerConfig(model=model), base=BASE)
    assert caught.value.setting == "model.context_window"


def test_c13_the_documented_bounds() -> None:
    """The bounds config.md states."""
    cases = {
        ("model", "context_window"): 2**31 - 1,
        ("attachments", "max_bytes"): 2**30,
        ("server", "max_frame_bytes"): 2**28,
        ("caps", "max_live_workers"): 4_194_304,
        ("caps", "queue_limit"): 2**31 - 1,
    }
    for (table, name), bound in cases.items():
        config_from_dict(_with(table, name, bound), base=BASE)
        assert refused(_with(table, name, bound + 1)).setting == f"{table}.{name}"


# -------------------------------------------------------------------- the file (C14)


def test_c14_a_device_is_not_a_configuration_file() -> None:
    """C14: ``/dev/null`` read as an empty document was a valid configuration of defaults
    (``/dev/zero`` would be read forever); anything but a regular file is refused by name."""
    with pytest.raises(ConfigError) as caught:
        load_config("/dev/null")
    assert caught.value.setting == "/dev/null"
    assert "not a regular file" in caught.value.message


def test_c14_a_directory_is_not_a_configuration_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert caught.value.setting == str(tmp_path)


def test_c14_a_symbolic_link_to_a_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "real.toml").write_text("[caps]\nqueue_limit = 7\n")
    (tmp_path / "link.toml").symlink_to("real.toml")
    assert load_config(tmp_path / "link.toml").caps.queue_limit == 7


@pytest.mark.parametrize(
    ("content", "words"),
    [
        pytest.param(b'state_dir = "st\xffate"\n', "UTF-8", id="not-utf8"),
        pytest.param(b"\xef\xbb\xbfpersona = 'x'\n", "not valid TOML", id="byte-order-mark"),
        pytest.param(b"a = " + b"[" * 20_000 + b"]" * 20_000, "nested", id="deep-arrays"),
        pytest.param(
            b"a = " + b"{b = " * 20_000 + b"1" + b"}" * 20_000, "nested", id="deep-tables"
        ),
    ],
)
def test_c14_a_file_the_parser_cannot_read_is_named_not_a_traceback(
    tmp_path: Path, content: bytes, words: str
) -> None:
    """C14: bytes that are not UTF-8 raised ``UnicodeDecodeError`` and arrays nested past the
    parser's recursion ``RecursionError``, neither a ``ConfigError``: ``serve`` printed a
    traceback."""
    file = tmp_path / "pi-runtime.toml"
    file.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load_config(file)
    assert caught.value.setting == str(file)
    assert words in caught.value.message


# ----------------------------------------------------------------- the result frame (C15)


@pytest.mark.parametrize(
    ("frame", "per_reply", "taken"),
    [
        (256 * 1024, 64, True),  # the defaults' frame with the most attachments
        (64 * 1024, 16, True),
        (32 * 1024, 16, False),  # sixteen attachments at their longest take more than half
        (32 * 1024, 4, True),
        (1024, 1, False),  # one attachment at its longest alone is more than half of 1 KiB
    ],
)
def test_c15_a_result_frame_leaves_half_of_itself_for_the_reply(
    frame: int, per_reply: int, taken: bool
) -> None:
    """C15: with ``max_per_reply`` attachments and every id at its longest, a reply's result
    frame leaves at least half of ``[server] max_frame_bytes`` for the text (protocol.md
    P14): else a configuration could promise a frame bound no reply keeps."""
    data = {
        "server": {"max_frame_bytes": frame},
        "attachments": {"max_per_reply": per_reply},
    }
    if taken:
        config_from_dict(data, base=BASE)
        return
    error = refused(data)
    assert error.setting == "server.max_frame_bytes"
    assert f"attachments.max_per_reply = {per_reply}" in error.message


@pytest.mark.parametrize(("chars", "taken"), [(600, True), (10_000, True), (20_000, False)])
def test_c15_a_text_update_at_its_longest_fits_a_frame(chars: int, taken: bool) -> None:
    """C15: a ``text_update`` of ``caps.text_update_chars`` characters (six bytes each at
    most, escaped) with the longest ids fits ``[server] max_frame_bytes`` (here 64 KiB), or
    the setting is refused: else a client built to the bound would be disconnected (1009)
    by an update."""
    data = {"server": {"max_frame_bytes": 64 * 1024}, "caps": {"text_update_chars": chars}}
    if taken:
        config_from_dict(data, base=BASE)
        return
    assert refused(data).setting == "caps.text_update_chars"
