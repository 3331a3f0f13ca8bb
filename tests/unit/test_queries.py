from iotmon.queries import explain


def test_a_python_error_inside_a_batch_is_summarised_by_its_cause() -> None:
    wrapped = (
        "An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):\n"
        '  File "job.py", line 3, in write\n'
        "    raise ValueError('bad row')\n"
        "ValueError: bad row\n"
    )
    assert explain(wrapped) == "ValueError: bad row"


def test_a_reset_broker_gets_a_hint() -> None:
    message = "[STREAM_FAILED] Partition t-0's offset was changed from 900 to 0, some data may have been missed.\nmore"
    summary, hint = explain(message).split("\n")
    assert summary.startswith("[STREAM_FAILED] Partition t-0's offset was changed")
    assert "iotmon reset" in hint


def test_an_ordinary_error_keeps_its_first_line() -> None:
    assert explain("Something broke\n\tat org.apache.Foo") == "Something broke"
