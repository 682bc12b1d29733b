"""Loading traces: every format on a small written file, every bad input, the real files."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from fragsim.errors import FragsimError
from fragsim.traces import BUNDLED_TRACES, load_trace, save_trace, trace_stats

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- each format on a written file -----------------------------------------------------


def test_azure_csv_reads_seven_digit_fractions_as_seconds_since_first() -> None:
    trace = load_trace(FIXTURES / "azure_small.csv")
    assert trace.name == "azure_small"
    assert trace.has_timestamps
    # 18:15:46.6805900 -> 18:15:50.9951690 is 4.3145790 s; 18:16:01.5 is 14.8194100 s.
    np.testing.assert_allclose(trace.arrival_s, [0.0, 4.314579, 4.31941, 14.81941], atol=1e-9)
    assert trace.prompt_len.tolist() == [374, 396, 879, 91]
    assert trace.output_len.tolist() == [44, 109, 42, 7]
    assert trace.block_hashes is None and trace.block_hash_size is None


def test_vidur_csv_rezeroes_arrivals_and_ignores_extra_columns() -> None:
    trace = load_trace(FIXTURES / "vidur_small.csv")
    assert trace.arrival_s.tolist() == [0.0, 0.5, 2.25]
    assert trace.prompt_len.tolist() == [120, 64, 2000]
    assert trace.output_len.tolist() == [30, 1, 48]


def test_length_only_csv_has_no_timestamps() -> None:
    trace = load_trace(FIXTURES / "lengths_small.csv")
    assert not trace.has_timestamps
    assert trace.arrival_s.tolist() == [0.0, 0.0, 0.0]
    assert trace.prompt_len.tolist() == [74, 290, 1]
    assert trace.output_len.tolist() == [918, 905, 2]


def test_mooncake_and_plain_csv_hold_the_same_three_requests() -> None:
    mooncake = load_trace(FIXTURES / "mooncake_small.jsonl")
    plain = load_trace(FIXTURES / "plain_small.csv")
    for trace in (mooncake, plain):
        assert trace.arrival_s.tolist() == [0.0, 0.25, 1.0]  # Mooncake: ms / 1000
        assert trace.prompt_len.tolist() == [600, 512, 1030]
        assert trace.output_len.tolist() == [10, 3, 20]
        assert trace.block_hashes == [(0, 1), (0,), (0, 1, 2)]
        assert trace.block_hash_size == 512


def test_format_is_told_by_content_not_extension(tmp_path: Path) -> None:
    renamed = tmp_path / "trace.txt"
    renamed.write_bytes((FIXTURES / "mooncake_small.jsonl").read_bytes())
    assert load_trace(renamed).block_hashes == [(0, 1), (0,), (0, 1, 2)]
    noext = tmp_path / "azure"
    noext.write_bytes((FIXTURES / "azure_small.csv").read_bytes())
    assert len(load_trace(noext)) == 4


def test_blank_lines_and_spaces_are_tolerated(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "arrival_time_s, prompt_len, output_len\n\n0, 5, 6\n1.5 ,7,8\n")
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == [0.0, 1.5]
    assert trace.prompt_len.tolist() == [5, 7]


def test_unsorted_rows_are_sorted_with_a_warning_counting_them(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "u.csv",
        "arrival_time_s,prompt_len,output_len,block_hashes\n5,1,1,5\n1,2,2,1\n3,3,3,3\n2,4,4,2\n",
    )
    with pytest.warns(UserWarning, match=r"u.csv: 2 of 4 rows arrive earlier"):
        trace = load_trace(path)
    assert trace.arrival_s.tolist() == [0.0, 1.0, 2.0, 4.0]
    assert trace.prompt_len.tolist() == [2, 4, 3, 1]
    assert trace.block_hashes == [(1,), (2,), (3,), (5,)]


def test_sorted_file_loads_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_trace(FIXTURES / "azure_small.csv")


def test_save_trace_round_trips_through_the_plain_csv(tmp_path: Path) -> None:
    original = load_trace(FIXTURES / "mooncake_small.jsonl")
    save_trace(original, tmp_path / "copy.csv")
    copy = load_trace(tmp_path / "copy.csv")
    assert copy.arrival_s.tolist() == original.arrival_s.tolist()
    assert copy.prompt_len.tolist() == original.prompt_len.tolist()
    assert copy.block_hashes == original.block_hashes
    assert [p.name for p in tmp_path.iterdir()] == ["copy.csv"]  # no temporary left behind


# --- bad input: one line naming the file, the row or line, and the field ----------------

AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
JSON_OK = '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}\n'

BAD_INPUTS = {
    "empty": ("e.csv", "", ["e.csv: empty file"]),
    "blank": ("b.csv", "  \n\n", ["b.csv: empty file"]),
    "header only": ("h.csv", AZURE_HEAD, ["h.csv: no data rows"]),
    "missing column": (
        "m.csv",
        "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n",
        [
            "m.csv: looks like Azure CSV",
            "GeneratedTokens",
            "TIMESTAMP,ContextTokens,GeneratedTokens",
        ],
    ),
    "missing vidur column": (
        "v.csv",
        "arrived_at,num_prefill_tokens\n1,2\n",
        ["looks like Vidur CSV", "lacks column(s) num_decode_tokens"],
    ),
    "unknown csv": (
        "u.csv",
        "foo,bar\n1,2\n",
        [
            "u.csv: unknown trace format",
            "'foo,bar'",
            "Azure CSV",
            "length-only CSV",
            "Mooncake JSONL",
        ],
    ),
    "non-numeric": (
        "n.csv",
        AZURE_HEAD + AZURE_ROW + "2023-11-16 18:15:47,abc,3\n",
        ["n.csv: row 2: field 'ContextTokens': expected a positive integer, got 'abc'"],
    ),
    "negative": (
        "neg.csv",
        AZURE_HEAD + AZURE_ROW * 16 + "2023-11-16 18:15:47,-3,3\n",
        ["neg.csv: row 17: field 'ContextTokens': expected a positive integer, got '-3'"],
    ),
    "zero": (
        "z.csv",
        AZURE_HEAD + AZURE_ROW + AZURE_ROW.replace(",44", ",0"),
        ["z.csv: row 2: field 'GeneratedTokens': expected a positive integer, got '0'"],
    ),
    "nan": (
        "nan.csv",
        "num_prefill_tokens,num_decode_tokens\n5,NaN\n",
        ["nan.csv: row 1: field 'num_decode_tokens': expected a positive integer, got 'NaN'"],
    ),
    "empty cell": (
        "ec.csv",
        "num_prefill_tokens,num_decode_tokens\n5,6\n,6\n",
        ["ec.csv: row 2: field 'num_prefill_tokens': expected a positive integer, got ''"],
    ),
    "fraction": (
        "f.csv",
        "arrival_time_s,prompt_len,output_len\n0,12.5,3\n",
        ["f.csv: row 1: field 'prompt_len': expected a positive integer, got '12.5'"],
    ),
    "bad datetime": (
        "d.csv",
        AZURE_HEAD + AZURE_ROW + AZURE_ROW + "yesterday,5,5\n",
        ["d.csv: row 3: field 'TIMESTAMP': expected a date-time", "got 'yesterday'"],
    ),
    "bad seconds": (
        "s.csv",
        "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,1,1\nsoon,1,1\n",
        ["s.csv: row 2: field 'arrived_at': expected a number of seconds >= 0, got 'soon'"],
    ),
    "infinite seconds": (
        "inf.csv",
        "arrival_time_s,prompt_len,output_len\ninf,1,1\n",
        ["inf.csv: row 1: field 'arrival_time_s': expected a number of seconds >= 0, got 'inf'"],
    ),
    "bad hash": (
        "bh.csv",
        "arrival_time_s,prompt_len,output_len,block_hashes\n0,1,1,3 4\n1,1,1,5 x\n",
        ["bh.csv: row 2: field 'block_hashes': expected integer block hashes, got '5 x'"],
    ),
    "ragged csv": (
        "r.csv",
        "num_prefill_tokens,num_decode_tokens\n1,2\n3,4,5\n",
        ["r.csv: malformed CSV", "line 3"],
    ),
    "bad json": ("j.jsonl", JSON_OK + '{"timestamp": 1,\n', ["j.jsonl: line 2: bad JSON"]),
    "json blank lines count": (
        "jb.jsonl",
        "\n" + JSON_OK + "\n" + JSON_OK.replace("600", "-600"),
        ["jb.jsonl: line 4: field 'input_length': expected a positive integer, got '-600'"],
    ),
    "json missing key": (
        "jm.jsonl",
        JSON_OK + JSON_OK + '{"timestamp": 5, "input_length": 3, "hash_ids": [1]}\n',
        ["jm.jsonl: line 3: field 'output_length': missing"],
    ),
    "json string length": (
        "js.jsonl",
        JSON_OK.replace("600", '"600"'),
        ["js.jsonl: line 1: field 'input_length': expected a positive integer, got '\"600\"'"],
    ),
    "json null timestamp": (
        "jt.jsonl",
        JSON_OK + JSON_OK.replace('"timestamp": 0', '"timestamp": null'),
        ["jt.jsonl: line 2: field 'timestamp': expected a number of milliseconds >= 0, got 'null'"],
    ),
    "negative seconds": (
        "ns.csv",
        "arrival_time_s,prompt_len,output_len\n0,1,1\n-2.5,1,1\n",
        ["ns.csv: row 2: field 'arrival_time_s': expected a number of seconds >= 0, got '-2.5'"],
    ),
    "json negative timestamp": (
        "jn.jsonl",
        JSON_OK + JSON_OK.replace('"timestamp": 0', '"timestamp": -40'),
        ["jn.jsonl: line 2: field 'timestamp': expected a number of milliseconds >= 0, got '-40'"],
    ),
    "json too few hashes": (
        "jf.jsonl",
        JSON_OK + JSON_OK.replace("[0, 1]", "[0]"),
        ["jf.jsonl: line 2: field 'hash_ids': expected 2 hashes (one per 512 tokens of "
         "input_length 600), got 1"],
    ),
    "csv too many hashes": (
        "cm.csv",
        "arrival_time_s,prompt_len,output_len,block_hashes\n0,512,1,3\n1,512,1,3 4\n",
        ["cm.csv: row 2: field 'block_hashes': expected 1 hashes (one per 512 tokens of "
         "prompt_len 512), got 2"],
    ),
    "json hash not list": (
        "jh.jsonl",
        JSON_OK.replace("[0, 1]", "7"),
        ["jh.jsonl: line 1: field 'hash_ids': expected a list of integers, got '7'"],
    ),
    "json hash not int": (
        "ji.jsonl",
        JSON_OK + JSON_OK.replace("[0, 1]", '[0, "a"]'),
        ["ji.jsonl: line 2: field 'hash_ids': expected integer block hashes"],
    ),
    "json array line": ("ja.jsonl", "[1, 2, 3]\n", ["ja.jsonl: line 1: expected a JSON object"]),
    "json unknown keys": (
        "jk.jsonl",
        '{"a": 1}\n',
        ["jk.jsonl: line 1: unknown trace format", "Mooncake JSONL"],
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_raises_one_line_naming_where(tmp_path: Path, case: str) -> None:
    name, text, expected = BAD_INPUTS[case]
    path = write(tmp_path, name, text)
    with pytest.raises(FragsimError) as info:
        load_trace(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    for part in expected:
        assert part in message


def test_missing_file_names_the_bundled_traces(tmp_path: Path) -> None:
    with pytest.raises(FragsimError, match="nope.csv: no such file .*azure-conv, azure-code"):
        load_trace(tmp_path / "nope.csv")


def test_directory_and_binary_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FragsimError, match="is a directory"):
        load_trace(tmp_path)
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(FragsimError, match="x.bin: not a UTF-8 text file"):
        load_trace(binary)


# --- bundled and real traces --------------------------------------------------------------


def test_bundled_names_resolve_to_the_packaged_copies() -> None:
    for name, file_name in BUNDLED_TRACES.items():
        trace = load_trace(name)
        assert trace.name == name
        assert trace.source == name
        assert file_name.endswith(".csv")
    assert len(load_trace("azure-conv")) == 19_366
    assert len(load_trace("azure-code")) == 8_819


# The public traces' README table. Means and percentiles there are rounded (7434 is
# 7433.7, 251.5 is 251.46), so they are compared to within 0.5.
README = {
    "azure_conv_2023.csv": (19_366, (1154.7, 1020, 4142, 14050), (211.1, 129, 601, 1000)),
    "azure_code_2023.csv": (8_819, (2047.9, 1469, 7436, 7437), (27.9, 13, 251.5, 1899)),
    "mooncake_conversation.jsonl": (
        12_031,
        (12035, 6909, 85400, 126195),
        (342.6, 350, 1118.5, 2000),
    ),
    "mooncake_synthetic.jsonl": (3_993, (15325, 11587, 66456, 191378), (149.1, 69, 768, 893)),
    "sharegpt_8k_lengths.csv": (30_731, (2340, 1730, 7434, 8141), (438.7, 415, 998, 1024)),
    "bwb_lengths.csv": (33_768, (1067, 1037, 1800, 3504), (1613, 1601, 2533, 2858)),
    "arxiv_summarization_lengths.csv": (28_257, (2588, 2730, 3933, 4054), (291.4, 167, 3271, 4056)),
}
README_TIMING = {  # duration s, rate req/s
    "azure_conv_2023.csv": (3501.7, 5.53),
    "azure_code_2023.csv": (3435.9, 2.57),
    "mooncake_conversation.jsonl": (3537.0, 3.40),
}


@pytest.mark.parametrize("file_name", README)
def test_real_trace_matches_the_readme_table(shared_traces: Path, file_name: str) -> None:
    trace = load_trace(shared_traces / file_name)
    stats = trace_stats(trace)
    rows, prompt, output = README[file_name]
    assert stats["num_requests"] == rows
    for prefix, expected in (("prompt_len", prompt), ("output_len", output)):
        mean, p50, p99, maximum = expected
        assert stats[f"{prefix}_mean"] == pytest.approx(mean, abs=0.5)
        assert stats[f"{prefix}_p50"] == pytest.approx(p50, abs=0.5)
        assert stats[f"{prefix}_p99"] == pytest.approx(p99, abs=0.5)
        assert stats[f"{prefix}_max"] == maximum
    assert trace.has_timestamps == (not file_name.endswith("_lengths.csv"))
    if file_name in README_TIMING:
        duration, rate = README_TIMING[file_name]
        assert stats["duration_s"] == pytest.approx(duration, abs=0.05)
        assert stats["rate_req_per_s"] == pytest.approx(rate, abs=0.005)


def test_azure_code_is_bursty_and_azure_conv_near_poisson(shared_traces: Path) -> None:
    code = trace_stats(load_trace(shared_traces / "azure_code_2023.csv"))
    conv = trace_stats(load_trace(shared_traces / "azure_conv_2023.csv"))
    assert round(code["interarrival_cv"]) == 13
    assert conv["interarrival_cv"] == pytest.approx(1.0, abs=0.15)


def test_mooncake_block_hashes_cover_each_prompt(shared_traces: Path) -> None:
    trace = load_trace(shared_traces / "mooncake_conversation.jsonl")
    stats = trace_stats(trace)
    assert stats["num_block_refs"] == 288_500
    assert stats["num_distinct_blocks"] == 182_790
    assert trace.block_hashes is not None
    counts = np.array([len(h) for h in trace.block_hashes])
    assert np.array_equal(counts, -(-trace.prompt_len // 512))


def test_bundled_copies_equal_the_public_files(shared_traces: Path) -> None:
    for name, file_name in BUNDLED_TRACES.items():
        bundled, public = load_trace(name), load_trace(shared_traces / file_name)
        assert np.array_equal(bundled.arrival_s, public.arrival_s)
        assert np.array_equal(bundled.prompt_len, public.prompt_len)
