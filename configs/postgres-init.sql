-- Run once by the postgres image on an empty data volume (docker-entrypoint-initdb.d).
-- POSTGRES_USER/POSTGRES_DB already created the role `hub` and the database `hub`; MLflow gets
-- its own role and database next to it.
CREATE ROLE mlflow WITH LOGIN PASSWORD 'mlflow';
CREATE DATABASE mlflow OWNER mlflow;
