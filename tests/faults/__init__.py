"""Fault suite: crashes, soaks, hostile clients, full disks (docs/reliability.md)."""
