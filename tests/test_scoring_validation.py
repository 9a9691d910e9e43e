"""Runs validate_measurement's case list and requires every case to pass."""

import os

from lla.scoring import validation


def test_all_validation_cases_pass(monkeypatch):
  # Durability is not under test here; hundreds of fsyncs on a shared disk
  # would dominate the runtime.
  monkeypatch.setattr(os, "fsync", lambda fd: None)
  results = validation.run_cases()
  failed = [(r["case"], r["got"]) for r in results if not r["pass"]]
  assert not failed, failed
  assert len(results) >= 37
  assert {r["kind"] for r in results} == {
      "known-answer", "recomputation", "fault-injection", "metamorphic"}
