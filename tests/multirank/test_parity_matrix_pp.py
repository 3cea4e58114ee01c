"""The parity matrix's pipeline layouts (tests/multirank/test_parity_matrix.py has the rest and the check)."""

import pytest

from tests.multirank.test_parity_matrix import PIPELINE_LAYOUTS, check_layout, single_process_references


@pytest.fixture(scope="module")
def references(gloo_world, tmp_path_factory):
    return single_process_references(gloo_world, tmp_path_factory)


@pytest.mark.parametrize("name,world_size,model_type,train", PIPELINE_LAYOUTS,
                         ids=[layout[0] for layout in PIPELINE_LAYOUTS])
def test_pipeline_layout_matches_single_process(name, world_size, model_type, train, gloo_world, references,
                                                tmp_path):
    check_layout(world_size, model_type, train, gloo_world, references, tmp_path)
