"""JupyterHub for a class of the course: each user gets the course's JupyterLab (with nbgrader's Assignments
panel) as their own system user, and nbgrader's exchange is a shared folder on this machine.

`python -m gpucourse hub` (`make hub`) copies this file into the hub's private runtime folder with SETTINGS
filled in, and starts `jupyterhub -f` on it. To adapt it to a real server, edit a copy (README: "Classroom on
JupyterHub"): the authenticator, TLS or a reverse proxy, and the spawner for GPU nodes.
"""
import os

c = get_config()  # noqa: F821 (provided by JupyterHub when it loads this file)

SETTINGS = {}  # filled in by gpucourse.classroom.write_config (python -m gpucourse hub)

runtime = SETTINGS["runtime"]

# -- The hub, its proxy (configurable-http-proxy, from npm) and their state: all on this machine's loopback,
# everything the hub writes in its private runtime folder. A public server listens on its public address
# behind TLS (c.JupyterHub.ssl_cert / ssl_key) or behind a reverse proxy that terminates TLS.
c.JupyterHub.ip = SETTINGS["ip"]
c.JupyterHub.port = SETTINGS["port"]
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = SETTINGS["hub_port"]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{SETTINGS['proxy_api_port']}"
c.ConfigurableHTTPProxy.pid_file = os.path.join(runtime, "jupyterhub-proxy.pid")
c.ConfigurableHTTPProxy.command = [SETTINGS["proxy_command"]]
c.JupyterHub.db_url = "sqlite:///" + os.path.join(runtime, "jupyterhub.sqlite")
c.JupyterHub.cookie_secret_file = os.path.join(runtime, "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = os.path.join(runtime, "jupyterhub.pid")
c.JupyterHub.cleanup_servers = True  # stopping the hub stops every user's server
c.JupyterHub.cleanup_proxy = True

# -- Who may log in. PAM: each user logs in with their own system account and password (the accounts the
# spawner runs servers as). On a real server, an OAuth or LDAP authenticator (oauthenticator,
# ldapauthenticator) with the same user names does the same without local passwords.
c.JupyterHub.authenticator_class = "pam"
# Only the class may log in: its instructors (the hub's admins), its students, and the members of its group.
c.Authenticator.admin_users = set(SETTINGS["instructors"])
c.Authenticator.allowed_users = set(SETTINGS["instructors"]) | set(SETTINGS["students"])
if SETTINGS["group"]:
    c.PAMAuthenticator.allowed_groups = {SETTINGS["group"]}

# An API token for the instructor's scripts (and the course's test): a service that may manage users, their
# servers and their tokens.
if SETTINGS["api_token"]:
    c.JupyterHub.services = [{"name": "course-admin", "api_token": SETTINGS["api_token"]}]
    c.JupyterHub.load_roles = [{"name": "course-admin", "services": ["course-admin"],
                                "scopes": ["admin:users", "admin:servers", "tokens", "list:users", "read:users"]}]

# -- Each user's server: the course's JupyterLab, run as that user (LocalProcessSpawner, the default; the hub
# runs as root for it). GPU nodes: DockerSpawner or KubeSpawner with a GPU limit, or SystemdSpawner with
# device access; see the README.
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [SETTINGS["singleuser"]]
c.Spawner.default_url = "/lab"
c.Spawner.ip = "127.0.0.1"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
# No news prompt: the course's JupyterLab settings (gpucourse.jupyter.write_lab_settings) set fetchNews to "false".
c.Spawner.args = ["--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                  *SETTINGS.get("lab_args", [])]
# nbgrader's exchange and course id come from the shared Jupyter config folder (its nbgrader_config.py);
# the course's code from the hub's Python environment (and COURSE_CODE when set: the folder holding the
# gpucourse, kernels and benchmarks packages).
c.Spawner.environment = {
    "JUPYTER_CONFIG_PATH": SETTINGS["jupyter_config"],
    "PATH": os.pathsep.join([os.path.dirname(SETTINGS["singleuser"]), "/usr/local/bin", "/usr/bin", "/bin"]),
    **({"PYTHONPATH": SETTINGS["course_code"]} if SETTINGS["course_code"] else {}),
    **({"GPUCOURSE_MODE": SETTINGS["mode"]} if SETTINGS["mode"] else {}),
}
