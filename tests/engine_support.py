"""Helpers the engine tests share: the leak check every test ends with, and a step loop that survives
interrupts."""


def assert_no_leak(llm):
    """Nothing left behind: no request, buffered output or claimed id, and every KV block free."""
    assert not llm.has_unfinished_requests()
    assert not llm._requests and not llm._outputs and not llm._claimed
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "KV blocks leaked"


def step_through_interrupts(llm, max_steps):
    """Step until every request finishes, swallowing KeyboardInterrupt as a user pressing Ctrl-C would
    (and then stepping on); returns the last output of each request."""
    outputs, steps = {}, 0
    while llm.has_unfinished_requests():
        steps += 1
        assert steps < max_steps
        try:
            outputs.update((o.request_id, o) for o in llm.step())
        except KeyboardInterrupt:
            pass
    return outputs
