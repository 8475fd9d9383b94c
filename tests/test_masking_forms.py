"""Masking: overlapping secrets mask the union of their matches; a secret's base64 and hex forms are masked."""

from __future__ import annotations

import base64

from hypothesis import given
from hypothesis import strategies as st

from guard.core.masking import Masker, command_line_secrets


def test_two_secrets_sharing_characters_leave_no_part_of_either_visible() -> None:
    first, second = "AAAAAAAAxyz123", "zzzAAAAAAAA"
    masker = Masker([first, second])
    assert masker.mask(b"key=zzzAAAAAAAAxyz123 end") == b"key=*** end"
    assert masker.mask(b"a=AAAAAAAAxyz123 b=zzzAAAAAAAA") == b"a=*** b=***"


@given(prefix=st.text(alphabet="abcdefghij:", max_size=5), user=st.text(alphabet="xyz", max_size=4))
def test_a_secrets_base64_inside_a_basic_auth_header_is_masked(prefix: str, user: str) -> None:
    secret = "s3cr3t-Value-123456"
    masker = Masker([secret])
    header = base64.b64encode(f"{prefix}{user}:{secret}".encode()).decode()
    masked = masker.mask(f"Authorization: Basic {header}".encode()).decode()
    assert "***" in masked
    assert base64.b64encode(secret.encode()).decode()[4:12] not in masked


def test_hex_and_url_safe_base64_forms_are_masked() -> None:
    secret = "s3cr3t-Value-123456"
    masker = Masker([secret])
    assert masker.mask(secret.encode().hex().encode()) == b"***"
    assert masker.mask(secret.encode().hex().upper().encode()) == b"***"
    assert masker.mask(base64.urlsafe_b64encode(secret.encode())) == b"***"
    assert masker.mask(base64.b64encode(secret.encode())) == b"***"


def test_options_named_with_several_words_give_their_values() -> None:
    argv = ["t.py", "--wandb-api-key", "abcdefgh1234", "--my.db-password=qwertyuiop", "--pad-token", "<pad>padpad"]
    assert command_line_secrets(argv) == ["abcdefgh1234", "qwertyuiop"]
