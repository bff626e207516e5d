/* cli/ — the multi-call `pdserve` binary (git style): main() dispatches to
 * one function per subcommand. Each returns a process exit code. */
#ifndef PD_CLI_H
#define PD_CLI_H

int pd_cmd_generate(int argc, char **argv);
int pd_cmd_mkmodel(int argc, char **argv);
int pd_cmd_tokenize(int argc, char **argv);
int pd_cmd_up(int argc, char **argv);
int pd_cmd_verify(int argc, char **argv);
int pd_cmd_version(int argc, char **argv);

#endif
