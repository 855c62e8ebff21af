-- docker/compose.yaml: run once by the postgres image on an empty data volume (mounted into
-- /docker-entrypoint-initdb.d), as POSTGRES_USER. POSTGRES_DB (sluicegate) is the metadata store; these
-- two are MLflow's backend store and the Prefect server's database. Each application creates its own
-- tables on start (`sluicegate db upgrade`, `mlflow server`, `prefect server start`).
CREATE DATABASE mlflow;
CREATE DATABASE prefect;
