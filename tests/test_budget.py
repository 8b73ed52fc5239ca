import pytest

from edgekv.budget import BudgetError, parse_budget
from edgekv.models import tiny_random_model
from edgekv.units import SizeError, human_bytes, parse_size


@pytest.mark.parametrize("text,tokens", [("8k", 8192), ("8192", 8192), ("0.5k", 512), ("2K", 2048), (" 1024 ", 1024)])
def test_token_budgets(text, tokens):
    assert parse_budget(text, block=128) == tokens


def test_byte_budgets_convert_from_model_geometry():
    cfg = tiny_random_model(0).config
    per_token = cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim * 4 + 4)
    assert parse_budget("512MiB", cfg, block=128) == 512 * 2**20 // per_token - 128
    assert parse_budget("1.5GB", cfg, block=128) == int(1.5e9) // per_token - 128
    assert parse_size("1.5GiB") == int(1.5 * 2**30)


@pytest.mark.parametrize("text,message", [
    ("lots", "cannot read budget"),
    ("0", "keeps no tokens"),
    ("64", "smaller than one block"),
    ("0.3", "not a whole number"),
    ("1KiB", "not enough for the cache plus one block"),
])
def test_bad_budgets(text, message):
    with pytest.raises(BudgetError, match=message):
        parse_budget(text, tiny_random_model(0).config, block=128)


def test_sizes_read_and_written():
    assert parse_size("100B") == 100 and parse_size(" 2 kb ") == 2000
    with pytest.raises(SizeError, match="cannot read 'lots' as a size"):
        parse_size("lots")
    assert [human_bytes(n) for n in (0, 1023, 1536, 3 * 2**30)] == ["0B", "1023B", "1.5KiB", "3.0GiB"]
