from __future__ import annotations

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.base.shape import JobShape, parse_job_shape


@pytest.mark.parametrize(("text", "shape"), [
    ("4", JobShape(min_nodes=1, max_nodes=1, nproc_per_node=4)),
    ("2x4", JobShape(min_nodes=2, max_nodes=2, nproc_per_node=4)),
    ("1:2x2", JobShape(min_nodes=1, max_nodes=2, nproc_per_node=2)),
])
def test_shapes(text: str, shape: JobShape) -> None:
    assert parse_job_shape(text) == shape


@pytest.mark.parametrize("bad", ["2x", "0x4", "2x0", "x4", "3:2x1", "two", "2x4x1", ""])
def test_bad_shapes_are_usage_errors(bad: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_job_shape(bad)
    assert exc.value.exit_code == 2


def test_a_shape_is_elastic_when_its_node_count_may_vary() -> None:
    assert parse_job_shape("1:2x2").is_elastic and str(parse_job_shape("1:2x2")) == "1:2x2"
    assert not parse_job_shape("2x4").is_elastic and parse_job_shape("2x4").nodes_text("-") == "2"
