-- The seed's conditional upsert of the job's result (L1), included by the
-- scripts with \ir: :payload and :token are psql variables.
INSERT INTO results (job_key, payload, token) VALUES ('job', :'payload', :token)
  ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
  WHERE results.token < excluded.token;
