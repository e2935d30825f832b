"""Config loading: every bad value is one clear line naming field, value and rule."""

import pytest

from dilonode.algo.codec_table import CODEC_NAMES
from dilonode.config import ConfigError, load_config, parse_overrides


@pytest.mark.parametrize("override,expected", [
    ("diloco.sync_every=0", "diloco.sync_every = 0: Input should be greater than or equal to 1"),
    ("diloco.fragment_sync_delay=30", "diloco.fragment_sync_delay = 30: must be < "
                                      "diloco.sync_every = 30"),
    ("codec.name='int3'", f"codec.name = 'int3': must be one of {', '.join(CODEC_NAMES)}"),
    ("codec.block_size=63", "codec.block_size = 63: must be even"),
    ("diloco.fragment_update_alpha=1.5", "diloco.fragment_update_alpha = 1.5"),
    ("diloco.mode='fast'", "diloco.mode = 'fast'"),
    ("data.source='text'", "data.path = None: source=text needs a path"),
    ("data.source='parquet'", "data.path = None: source=parquet needs a path"),
    ("data.source='arrow'", "data.path = None: source=arrow needs a path"),
    ("data.source='csv'", "data.source = 'csv': Input should be"),
    ("data.shard_index=1", "data.shard_count = None: data.shard_index and data.shard_count "
                           "are set together"),
    ("data.shard_count=2", "data.shard_index = None: data.shard_index and"),
    ("data.unit_rows=0", "data.unit_rows = 0: Input should be greater than or equal to 1"),
    ("model.kind='factory'", "model.factory = None: kind=factory needs"),
    ("run_id='has space'", "run_id = 'has space'"),
    ("diloco.bogus=1", "diloco.bogus = 1: Extra inputs are not permitted"),
    ("inner.lr=-1", "inner.lr = -1: Input should be greater than 0"),
    ("network.host='0.0.0.0'", "network.host = '0.0.0.0': peers cannot dial a wildcard"),
])
def test_each_bad_value_is_one_line_naming_it(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=parse_overrides([override]))
    message = str(info.value)
    assert "\n" not in message
    assert expected in message
    assert message.startswith("config error")


def test_data_shards_and_streamed_sources():
    with pytest.raises(ConfigError, match="data.shard_index = 2: must be below "
                                          "data.shard_count = 2") as info:
        load_config(overrides={"data": {"shard_index": 2, "shard_count": 2}})
    assert "\n" not in str(info.value)
    cfg = load_config(overrides={"data": {"source": "parquet", "path": "/corpus",
                                          "shard_index": 1, "shard_count": 4}})
    assert (cfg.data.text_column, cfg.data.split, cfg.data.unit_rows) == ("text", "train", 4096)
    # The config reference is generated from the fields' descriptions.
    for name in ("text_column", "split", "unit_rows", "shard_index", "shard_count"):
        assert type(cfg.data).model_fields[name].description


def test_several_errors_one_line_each():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=parse_overrides(["diloco.sync_every=0", "inner.lr=0"]))
    assert len(str(info.value).splitlines()) == 2


def test_toml_file_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('total_steps = 7\n[diloco]\nsync_every = 11\nnum_fragments = 2\n')
    cfg = load_config(path, parse_overrides(["diloco.num_fragments=1", "codec.name=fp4"]))
    assert (cfg.total_steps, cfg.diloco.sync_every, cfg.diloco.num_fragments) == (7, 11, 1)
    assert cfg.codec.name == "fp4"


def test_bad_toml_and_missing_file_are_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("total_steps = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(bad)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected section.field=value"):
        parse_overrides(["diloco.sync_every"])


def test_auto_merge_delay_resolves_from_h_and_p_and_names_itself_when_invalid():
    cfg = load_config(overrides={"diloco": {"fragment_sync_delay": "auto", "sync_every": 30,
                                            "num_fragments": 3}})
    assert cfg.diloco.effective().fragment_sync_delay == 5
    with pytest.raises(ConfigError, match=r"diloco.fragment_sync_delay = 'auto' \(1\): must "
                                          r"be < diloco.sync_every = 1"):
        load_config(overrides={"diloco": {"fragment_sync_delay": "auto", "sync_every": 1,
                                          "num_fragments": 1}})
    with pytest.raises(ConfigError, match="'auto': needs diloco.pacing = 'time'"):
        load_config(overrides={"diloco": {"fragment_sync_delay": "auto", "pacing": "steps"}})


def test_diloco_mode_pins_plain_diloco():
    cfg = load_config(overrides={"diloco": {"mode": "diloco", "num_fragments": 3,
                                            "fragment_sync_delay": 2}})
    eff = cfg.diloco.effective()
    assert (eff.num_fragments, eff.fragment_sync_delay, eff.fragment_update_alpha) == (1, 0, 0.0)


def test_example_configs_load():
    from pathlib import Path
    paths = sorted(Path(__file__).parents[2].joinpath("configs").glob("*.toml"))
    assert len(paths) >= 4
    for path in paths:
        load_config(path)


@pytest.mark.parametrize("items,expected", [
    (["codec.name='float32'", "codec.error_feedback=true"],
     "codec.error_feedback = true with codec.name = float32 and codec.kind = dense"),
    (["codec.error_decay=0.5"], "codec.error_decay = 0.5 needs codec.error_feedback = true"),
    (["codec.error_store='buffer'"],
     "codec.error_store = 'buffer' needs codec.error_feedback = true"),
    (["codec.error_feedback=true", "codec.error_store='buffer'"],
     "codec.error_store = 'buffer' with diloco.fragment_update_alpha = 0.5: the merge keeps"),
    (["codec.error_feedback=true", "codec.error_store='momentum'"],
     "codec.error_store = 'momentum': Input should be 'weights' or 'buffer'"),
    (["codec.topk_density=0.1"], "codec.topk_density = 0.1 needs codec.kind = randk or topk"),
    (["codec.kind='randk'", "codec.topk_density=0"], "codec.topk_density = 0: Input should"),
    (["codec.error_feedback=true", "codec.error_decay=0"], "codec.error_decay = 0: Input"),
    (["codec.kind='sparse'"], "codec.kind = 'sparse': Input should be 'dense', 'randk' or"),
    (["codec.kind='topk'", "codec.topk_density=1.5"], "codec.topk_density = 1.5: Input"),
    (["codec.kind='topk'", "aggregator.name='trimmed_mean'"],
     "codec.kind = topk with aggregator.name = trimmed_mean"),
    (["codec.kind='topk'", "aggregator.name='centered_clip'"],
     "codec.kind = topk with aggregator.name = centered_clip"),
    (["codec.kind='topk'", "network.chunk_numel=5000"],
     "codec.kind = topk with network.chunk_numel = 5000: must be a multiple of 4096"),
    (["codec.kind='topk'", "dist.nproc=2"], "codec.kind = topk with dist.nproc = 2"),
    (["codec.name='int2'", "codec.block_size=6"], "codec.block_size = 6: must be a multiple "
                                                  "of 4 for int2"),
    (["codec.name='sign1'", "codec.block_size=12"], "codec.block_size = 12: must be a "
                                                    "multiple of 8 for sign1"),
    (["codec.kind='randk'", "dist.nproc=2"], "codec.kind = randk with dist.nproc = 2"),
    (["codec.error_feedback=true", "diloco.mode='ddp'"],
     "codec.error_feedback = true with diloco.mode = ddp"),
])
def test_wrong_codec_combinations_stop_with_one_line_naming_the_fields(items, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=parse_overrides(items))
    assert "\n" not in str(info.value) and expected in str(info.value)


def test_sparse_and_error_feedback_settings_load_and_survive_a_dump():
    cfg = load_config(overrides=parse_overrides([
        "codec.name='int2'", "codec.kind='randk'", "codec.topk_density=0.01",
        "codec.error_feedback=true", "codec.error_decay=0.95"]))
    assert (cfg.codec.kind, cfg.codec.topk_density, cfg.codec.error_decay) == \
        ("randk", 0.01, 0.95)
    top = load_config(overrides=parse_overrides([
        "codec.name='int2'", "codec.kind='topk'", "codec.topk_density=0.0156"]))
    assert top.codec.wire_name == "topk64_int2" and cfg.codec.wire_name == "int2"
    assert load_config(overrides=top.model_dump()) == top
    dense = load_config()
    assert load_config(overrides=dense.model_dump()) == dense  # a dump sets every field
    assert load_config(overrides=cfg.model_dump()) == cfg
