"""Where the hierarchical allreduce is taken (``topology.hierarchical``) and how a buffer is
cut into its stripes (``hierarchy.stripes``): pure logic, every rank's decision alike."""

from __future__ import annotations

import pytest

from ipydist.torch._core.topology import hierarchical
from ipydist.torch._wire.hierarchy import stripes


@pytest.mark.parametrize("setting, hosts, homogeneous, local_size, consecutive, taken", [
    ("auto", 1, True, 4, True, False),  # one host: shared memory already
    ("auto", 2, True, 1, True, False),  # a rank a host: nothing to reduce locally
    ("auto", 2, True, 2, True, False),  # by slot: MPI's flat exchanges stay on the hosts
    ("auto", 3, True, 2, True, False),
    ("auto", 2, True, 2, False, True),  # dealt out by node
    ("auto", 3, True, 2, False, True),
    ("auto", 2, False, 2, False, False),  # hosts with different rank counts: no stripes
    ("mpi", 2, True, 2, False, False),
    ("gloo", 2, True, 2, False, False),
    ("hierarchical", 1, True, 4, True, True),  # forced, even on one host
    ("hierarchical", 2, False, 2, True, False),
])
def test_where_the_hierarchy_is_taken(setting, hosts, homogeneous, local_size, consecutive,
                                      taken):
    assert hierarchical(setting, hosts, homogeneous, local_size, consecutive) is taken


@pytest.mark.parametrize("count, local_size, expected", [
    (10, 2, [5, 5]), (10, 3, [4, 3, 3]), (2, 4, [1, 1, 0, 0]), (0, 2, [0, 0]),
])
def test_stripes_cover_the_buffer_as_evenly_as_can_be(count, local_size, expected):
    assert stripes(count, local_size) == expected
    assert sum(stripes(count, local_size)) == count
