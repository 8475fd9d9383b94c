"""Tests for ``guard.core.masking``: which values are secret, their encoded forms, and ``safe_len``."""

from __future__ import annotations

import json
import urllib.parse

import pytest

from guard.core.masking import MASK, Masker, secret_values

HF = "hf_" + "abcdefghijklmnopqrstuvwxyzABCDEFGH"  # 34 letters, as real tokens


@pytest.mark.parametrize("name", ["HF_TOKEN", "hf_token", "MY_API_KEY", "apikey", "Aws_Secret_Access",
                                  "DB_PASSWORD", "password", "WANDB_API_KEY", "GH_TOKEN_2"])
def test_secret_names_any_case(name: str) -> None:
    assert secret_values({name: "value-12345"}) == ["value-12345"]


def test_other_names_short_values_and_blank_values_are_not_secret() -> None:
    environ = {
        "HOME": "/home/someone-long",
        "PATH": "/usr/bin:/bin",
        "MY_TOKEN": "short7!",  # 7 characters: ignored (it would mangle ordinary output)
        "MY_KEY": "        ",  # whitespace only
        "AN_API_KEY": "exactly8",
    }
    assert secret_values(environ) == ["exactly8"]


def test_masker_from_environ_masks_the_values() -> None:
    masker = Masker.from_environ({"MY_API_TOKEN": "s3cr3t-Value-1234567", "USER": "alice-the-user"})
    assert masker.mask(b"token=s3cr3t-Value-1234567 user=alice-the-user") == b"token=*** user=alice-the-user"
    assert masker.mask_text("a s3cr3t-Value-1234567 b") == "a *** b"


def test_short_values_given_directly_are_ignored() -> None:
    masker = Masker(["abc"])
    assert masker.mask(b"abc abc") == b"abc abc"


def test_every_occurrence_is_masked() -> None:
    masker = Masker(["0123456789"])
    assert masker.mask(b"0123456789 and 0123456789!") == b"*** and ***!"


def test_url_quoted_and_json_escaped_forms() -> None:
    secret = 'p@ss w/rd"\\x+y'
    masker = Masker([secret])
    quoted = urllib.parse.quote(secret, safe="")
    plus = urllib.parse.quote_plus(secret)
    escaped = json.dumps(secret)[1:-1]
    assert len({secret, quoted, plus, escaped}) == 4  # four different texts
    for form in (secret, quoted, plus, escaped):
        data = f"before {form} after".encode()
        assert masker.mask(data) == b"before *** after", form
    assert masker.mask(json.dumps({"url": f"https://u:{secret}@host"}).encode()) == b'{"url": "https://u:***@host"}'


def test_a_value_containing_another_is_masked_whole() -> None:
    masker = Masker(["abcdefgh", "abcdefgh-and-more"])
    assert masker.mask(b"x abcdefgh-and-more y") == b"x *** y"


def test_hf_tokens_are_masked_without_being_in_the_environment() -> None:
    masker = Masker()
    assert masker.mask(f"token {HF} end".encode()) == b"token *** end"
    assert masker.mask(b"hf_" + b"a" * 30) == MASK
    assert masker.mask(b"hf_" + b"a" * 29) == b"hf_" + b"a" * 29  # too short for a token
    assert masker.mask(b"hf_hub_download") == b"hf_hub_download"


def test_safe_len_holds_back_the_start_of_a_secret() -> None:
    masker = Masker(["s3cr3t-Value-1234567"])
    assert masker.safe_len(b"hello world") == len(b"hello world")
    assert masker.safe_len(b"hello s3cr") == len(b"hello ")
    assert masker.safe_len(b"hello s") == len(b"hello ")
    assert masker.safe_len(b"s3cr3t-Value-123456") == 0  # everything but the last character
    # A complete secret at the end is not held: masking it now is safe.
    whole = b"hello s3cr3t-Value-1234567 "
    assert masker.safe_len(whole) == len(whole)
    # ... unless a held tail begins another form inside it (its last "7" begins its hex, "7333..."): then the whole
    # secret is held with that tail, never cut in two
    assert masker.safe_len(whole.rstrip()) == len(b"hello ")
    assert masker.safe_len(b"") == 0


def test_safe_len_holds_back_a_possible_hf_token() -> None:
    masker = Masker()
    assert masker.safe_len(b"load h") == len(b"load ")
    assert masker.safe_len(b"load hf") == len(b"load ")
    assert masker.safe_len(b"load hf_abcdEFG") == len(b"load ")
    assert masker.safe_len(("load " + HF).encode()) == len(b"load ")  # more letters may follow
    assert masker.safe_len(b"load hf_abc ") == len(b"load hf_abc ")  # a space ends it


def test_safe_len_holds_the_start_of_an_encoded_form() -> None:
    secret = "p@ss w/rd-123"
    masker = Masker([secret])
    quoted = urllib.parse.quote(secret, safe="").encode()
    data = b"url: " + quoted[:6]
    assert masker.safe_len(data) == len(b"url: ")


def test_split_secret_never_leaks_through_safe_len_at_any_offset() -> None:
    secret = b"s3cr3t-Value-1234567"
    masker = Masker([secret.decode()])
    line = b"the secret is " + secret + b" in full\n"
    for cut in range(len(line)):
        head, tail = line[:cut], line[cut:]
        safe = masker.safe_len(head)
        written = masker.mask(head[:safe]) + masker.mask(head[safe:] + tail)
        assert secret not in written, cut
        assert written == b"the secret is *** in full\n", cut


# ---------------------------------------------------------------------------------------------------------------
# Cost: bounded for large and many secrets
# ---------------------------------------------------------------------------------------------------------------


def test_a_large_secret_split_across_reads_is_held_back_and_masked() -> None:
    pem = "-----BEGIN PRIVATE KEY-----\n" + "AbCd+/09" * 1024 + "\n-----END PRIVATE KEY-----"
    masker = Masker([pem])
    data = b"progress " * 100 + pem.encode()[:5000]
    assert masker.safe_len(data) == len(b"progress " * 100)
    assert masker.safe_len(data + b"x") == len(data) + 1  # no longer a beginning of the secret
    assert masker.mask(b"key: " + pem.encode() + b" end") == b"key: *** end"
    # No table of the secret's prefixes is kept: the masker holds the secret's forms and nothing that grows with
    # the square of its length.
    held = sum(len(value) for value in vars(masker).values() if isinstance(value, (bytes, str)))
    held += sum(len(form) for form in masker._secrets)
    assert held < 4 * 4 * len(pem)
    assert not any(isinstance(value, dict) for value in vars(masker).values())


def test_safe_len_with_many_secrets_finds_the_longest_held_tail() -> None:
    secrets = [f"secret-{n:04d}-value" for n in range(300)]
    masker = Masker(secrets)
    assert masker.safe_len(b"line secret-0299-va") == len(b"line ")
    assert masker.safe_len(b"line secr") == len(b"line ")
    assert masker.safe_len(b"line secret-9999") == len(b"line secret-9999")
    assert masker.mask(b"a secret-0007-value b secret-0123-value") == b"a *** b ***"


def test_a_beginning_that_repeats_inside_the_tail_is_found() -> None:
    masker = Masker(["abcabcabX"])
    assert masker.safe_len(b"zzabcabcab") == len(b"zz")  # "abcabcab" is a beginning; "abcab" would be too short
    assert masker.safe_len(b"abcabcabc") == len(b"abc")  # the whole is no beginning (X), "abcabc" is


# ---------------------------------------------------------------------------------------------------------------
# Every logger and every warning that reaches the guard's output
# ---------------------------------------------------------------------------------------------------------------


def test_other_loggers_and_warnings_are_masked(capfd: pytest.CaptureFixture[str]) -> None:
    import logging
    import warnings

    from guard.run import cli

    secret = "s3cr3t-Value-1234567"
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        cli._setup_logging(Masker([secret]), {})
        logging.getLogger("guard.test").warning("guard line %s", secret)
        logging.getLogger("urllib3.connectionpool").warning("retrying https://u:%s@host", secret)
        try:
            raise ValueError(f"bad value {secret}")
        except ValueError:
            logging.getLogger("some.library").exception("failed")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn(f"deprecated token {secret}", UserWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
    err = capfd.readouterr().err
    assert secret not in err
    assert "guard line ***" in err
    assert "retrying https://u:***@host" in err
    assert "ValueError: bad value ***" in err
    assert "UserWarning: deprecated token ***" in err


def test_command_line_secrets_follow_secret_named_options() -> None:
    from guard.core.masking import command_line_secrets

    argv = ["train.py", "--wandb-key", "abcd1234efgh", "--hf_token=tok-5678-abcd", "--api_key", "-x",
            "--tokenizer_name", "gpt2-medium", "--max_tokens", "100000000", "--eos_token", "<|endoftext|>",
            "--db.password=pw12345678", "--client-secret", "cs-0000-1111"]
    assert command_line_secrets(argv) == ["abcd1234efgh", "tok-5678-abcd", "pw12345678", "cs-0000-1111"]


def test_the_rare_byte_gate_masks_what_a_search_of_every_form_masks() -> None:
    """``mask`` skips a form when the output lacks its rarest byte: the same result as searching every form, for
    secrets of every alphabet inside random text."""
    import random

    from guard.core.masking import MASK, Masker

    rng = random.Random(7)
    alphabets = ["abcdefghijklmnopqrstuvwxyz", "0123456789abcdef", "ABCDEFGHIJKLMNOPQRSTUVWXYZ+/=%_-. "]
    for _ in range(300):
        secrets = ["".join(rng.choice(rng.choice(alphabets)) for _ in range(rng.randint(8, 40)))
                   for _ in range(rng.randint(1, 3))]
        masker = Masker(secrets)
        forms = masker._secrets
        pieces = [rng.choice([*forms, "".join(rng.choice(alphabets[0] + " \n") for _ in range(30)).encode()])
                  for _ in range(rng.randint(1, 6))]
        data = b"".join(pieces)
        masked = masker.mask(data)
        assert all(form not in masked for form in forms if len(form) > len(MASK))
        ungated = Masker(secrets)
        ungated._gated = [(b"", form) for form in forms]  # b"" is in every bytes: every form searched
        assert masked == ungated.mask(data)


def test_a_trackio_write_token_in_a_url_is_masked() -> None:
    """Issue 36: trackio's dashboard URL (``trackio.show()``, ``trackio show``) carries a key that lets anyone log
    to the project; the guard masks it in everything it writes."""
    masker = Masker()
    line = "* Trackio UI: http://127.0.0.1:7860/?project=jobguard&write_token=Zq7_kLm9-0aBcDeF1234&x=1\n"
    assert masker.mask_text(line) == "* Trackio UI: http://127.0.0.1:7860/?project=jobguard&write_token=***&x=1\n"
    assert masker.mask_text("write_token=short") == "write_token=short"  # not a key: under 8 characters


def test_the_aws_variables_of_an_s3_destination_are_secrets() -> None:
    # --push-to s3://: the standard AWS variables (botocore's names) are masked like every other secret
    from guard.core.masking import secret_values

    environ = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY0001", "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG",
               "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEExample", "AWS_REGION": "eu-west-1",
               "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}
    assert sorted(secret_values(environ)) == sorted(environ[k] for k in ("AWS_ACCESS_KEY_ID",
                                                                          "AWS_SECRET_ACCESS_KEY",
                                                                          "AWS_SESSION_TOKEN"))
