"""Moving bytes: transfer engines, TierIO, the JobExecutor over them and the JobLedger."""
