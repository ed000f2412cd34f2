"""What validation reports: findings (errors and warnings) and notes on skipped checks."""

from __future__ import annotations

from dataclasses import dataclass, field

LEVELS = ("error", "warning")


@dataclass(frozen=True)
class Finding:
    """One problem found in a preset.

    ``level`` is ``"error"`` (the preset must not be served as is) or
    ``"warning"`` (it runs, but probably not as intended); ``rule`` names the
    check (see ``dsv4 validate --rules``); ``message`` says what to change.
    """

    level: str
    rule: str
    message: str

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")

    def __str__(self) -> str:
        return f"{self.level}: [{self.rule}] {self.message}"


@dataclass
class Report:
    """Findings plus what the checks could and could not cover."""

    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Checks that were skipped, and why (e.g. they need the model's config.json)."""
    vllm_version: str | None = None
    """The vLLM whose parser checked the preset, ``None`` when vLLM was not used."""
    vllm_release: str | None = None
    """The release (``"0.33"``) whose facts and checks were used: that of
    ``vllm_version`` when vLLM was used, else the release of the shipped
    option table the offline checks read."""

    @property
    def errors(self) -> list[Finding]:
        """The findings of level ``error``."""
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        """The findings of level ``warning``."""
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings allowed)."""
        return not self.errors
