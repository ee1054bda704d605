"""Moving bytes: transfer engines, DiskIO, the JobExecutor over them and the JobLedger."""
