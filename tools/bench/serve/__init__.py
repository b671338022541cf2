"""`tiercache bench serve`: serving under load, its workload, its client, its report and its events audit."""
