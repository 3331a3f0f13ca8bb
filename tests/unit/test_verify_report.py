from ingest.verify import PartitionCheck, Reconciliation, TruthCheck


def _exact() -> Reconciliation:
    return Reconciliation(
        topic="t",
        partitions=[PartitionCheck(0, 0, 10, 10, 0, 0, 0), PartitionCheck(1, 5, 8, 7, 0, 0, 0)],
        bronze_malformed=2,
        quarantine_rows=2,
        quarantine_not_in_bronze=0,
        quarantine_duplicates=0,
        truth=TruthCheck(sends=17, delivered=17, missing_from_bronze=0, parsed_differently=0, malformed_accepted=0),
    )


def test_exact_reconciliation_has_no_problems() -> None:
    result = _exact()
    assert result.problems == []
    assert "RESULT: exact" in result.report()


def test_each_kind_of_mismatch_is_reported() -> None:
    result = _exact()
    result.partitions[0] = PartitionCheck(0, 0, 10, 11, missing=1, duplicates=2, beyond_high=0)
    result.quarantine_rows = 1
    result.truth = TruthCheck(17, 17, missing_from_bronze=1, parsed_differently=0, malformed_accepted=3)
    problems = result.problems
    assert any("partition 0: 1 Kafka records missing, 2 duplicated" in p for p in problems)
    assert any("quarantine holds 1 rows but bronze has 2" in p for p in problems)
    assert any("1 delivered sends missing" in p and "3 corrupted sends accepted" in p for p in problems)
    assert "RESULT: MISMATCH" in result.report()
