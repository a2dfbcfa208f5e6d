from tools.bench_admission import Workload, run_policy, servable


def test_bench_admission_workload_conversations_grow_and_documents_are_seen_once():
    workload = Workload(users=3, context_blocks=5, rounds=2, round_blocks=1, prefixes=2, prefix_blocks=4,
                        prefix_requests=4, tail_blocks=1, documents=3, document_blocks=9)
    requests = workload.requests()
    assert requests == workload.requests()  # seeded
    assert len(requests) == 3 * 2 + 4 + 3
    rounds = [chain for chain in requests if len(chain) in (6, 7)]
    firsts = [chain for chain in rounds if len(chain) == 6]
    # each user's second round extends its first and comes after it
    for first in firsts:
        second = next(chain for chain in rounds if len(chain) == 7 and chain[:6] == first)
        assert requests.index(second) > requests.index(first)
    assert len(firsts) == 3
    documents = [chain for chain in requests if len(chain) == 9]
    assert len(documents) == 3 and len({block for chain in documents for block in chain}) == 27


def test_bench_admission_servable_counts_each_requests_stored_prefix():
    assert servable([[1, 2, 3], [1, 2, 4], [5], [1, 2, 4, 6], [9, 1]]) == 0 + 2 + 0 + 3 + 0


def test_bench_admission_small_run_serves_checked_blocks_from_the_disk_tier(tmp_path):
    # 4 users of 40 blocks, 3 rounds, through a 128-block pool: later rounds need the disk.
    workload = Workload(users=4, rounds=3, prefix_requests=8, documents=2)
    requests = workload.requests()
    result = run_policy("evicted", requests, "2MiB", "16MiB", tmp_path / "d")
    assert result.wrong_blocks == 0 and result.failed_loads == 0
    assert result.requests == len(requests)
    assert 0 < result.served <= servable(requests)
    disk = {k: v for k, v in result.engine.items() if k.startswith("disk_")}  # (what a failure says)
    assert result.served_from_disk > 0 and result.engine["disk_blocks_written"] > 0, disk
